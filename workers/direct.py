"""The reference: prompts run straight on vLLM's AsyncLLM, with VLLMEngine's settings and no rollout-svc queue.

Used by the "service vs direct vLLM: token-identical" test and by the throughput benchmark
(service tok/s / direct tok/s). From the command line:

    python -m workers.direct --model DIR --prompts-file IN.json --out OUT.json [--dtype float32]
        [--max-tokens N] [--temperature 0] [--sequential] [--lora-path DIR --enable-lora]
        [any engine setting of `python -m workers`]

IN.json is a JSON list of prompts, each a list of token ids. OUT.json gets
`{"outputs": [{"completion_token_ids": [...], "logprobs": [...]}, ...], "output_tokens": N,
"elapsed_s": S, "output_tokens_per_s": X}`, outputs in prompt order.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import time
from pathlib import Path
from typing import Any

from rollout_svc.config import EngineSettings
from workers.vllm_args import shutdown_llm, usage_context, vllm_engine_args
from workers.vllm_outputs import sampled_logprobs


async def run_prompts(
    llm: Any,
    prompts: list[list[int]],
    sampling_params: Any,
    sequential: bool,
    max_tokens: int | None = None,
    lora_request: Any = None,
) -> dict[str, Any]:
    """Generate one completion per prompt on a started `AsyncLLM`; return the OUT.json dict.

    `sampling_params` is a `vllm.SamplingParams` with `logprobs=0, flat_logprobs=True, output_kind=FINAL_ONLY`.
    `sequential` awaits each prompt before sending the next; otherwise all are in flight at once (continuous
    batching). `max_tokens` overrides the params' own. `elapsed_s` is wall-clock seconds for the generation
    alone, not the engine's startup. `lora_request`: a vLLM `LoRARequest` every prompt runs with.
    """
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    from vllm.inputs import tokens_input

    async def one(index: int, prompt: list[int]) -> dict[str, Any]:
        # FINAL_ONLY: vLLM yields once, when the request is done.
        stream = llm.generate(tokens_input(prompt), sampling_params, f"direct-{index}", lora_request=lora_request)
        finals = [final async for final in stream]
        output = finals[-1].outputs[0]
        return {"completion_token_ids": list(output.token_ids), "logprobs": sampled_logprobs(output)}

    started_s = time.perf_counter()
    if sequential:
        outputs = [await one(i, prompt) for i, prompt in enumerate(prompts)]
    else:
        outputs = list(await asyncio.gather(*(one(i, prompt) for i, prompt in enumerate(prompts))))
    elapsed_s = time.perf_counter() - started_s
    output_tokens = sum(len(o["completion_token_ids"]) for o in outputs)
    return {
        "outputs": outputs,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": output_tokens / elapsed_s if elapsed_s > 0 else 0.0,
    }


async def run_direct(
    model: str,
    prompts: list[list[int]],
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    sequential: bool = False,
    warmup: bool = False,
    lora_path: str | None = None,
    **engine_settings: Any,
) -> dict[str, Any]:
    """Start an AsyncLLM from `vllm_engine_args(model, **engine_settings)`, run `prompts`, shut it down.

    `warmup` first runs the first two prompts for 4 tokens, untimed: what the benchmark's service side does
    too, so first-call costs (kernel set-up, the prefix cache of those two prompts) fall alike on both.
    `lora_path`: every prompt runs with the LoRA adapter in that directory (`LoRARequest("direct", 1, lora_path)`;
    the engine needs `enable_lora`). Returns `run_prompts`' dict. The caller's entry point needs an
    `if __name__ == "__main__":` guard (vLLM spawns its engine core).
    """
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    sampling_params = SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        logprobs=0,
        flat_logprobs=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    # Built on the loop, blocking it for the ~15 s startup: nothing else runs here, and elapsed_s starts later.
    llm = AsyncLLM.from_engine_args(vllm_engine_args(model, **engine_settings), usage_context=usage_context())
    try:
        if warmup:
            await run_prompts(llm, prompts[:2], sampling_params.clone(), sequential=False, max_tokens=4)
        lora = None if lora_path is None else LoRARequest(lora_name="direct", lora_int_id=1, lora_path=lora_path)
        return await run_prompts(llm, prompts, sampling_params, sequential, lora_request=lora)
    finally:
        shutdown_llm(llm)
        del llm  # collected while vLLM's globals exist (see shutdown_llm)
        gc.collect()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.direct", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts-file", type=Path, required=True, help="JSON list of lists of prompt token ids")
    parser.add_argument("--out", type=Path, required=True, help="where to write the results JSON")
    EngineSettings.add_arguments(parser, engine=False)  # the worker's engine settings, so both run the same
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    parser.add_argument("--sequential", action="store_true", help="one prompt at a time, else all at once")
    parser.add_argument("--warmup", action="store_true", help="first run 2 prompts for 4 tokens, untimed")
    parser.add_argument("--lora-path", help="run every prompt with this LoRA adapter (needs --enable-lora)")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # the dtype line
    engine = EngineSettings.from_args(args)
    if engine.model is None:
        parser.error("--model is required")
    prompts = json.loads(args.prompts_file.read_text())
    result = asyncio.run(
        run_direct(
            engine.model,
            prompts,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            sequential=args.sequential,
            warmup=args.warmup,
            lora_path=args.lora_path,
            **engine.vllm_kwargs(),
        )
    )
    args.out.write_text(json.dumps(result))
    print(f"{result['output_tokens']} tokens in {result['elapsed_s']:.2f} s: {result['output_tokens_per_s']:.1f} tok/s")


if __name__ == "__main__":
    main()
