"""VLLMEngine on the real model: token-identical to vLLM run directly, errors mapped, no process left behind."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from rollout_svc.config import Settings
from rollout_svc.errors import InvalidRequestError
from rollout_svc.model import prepare_model
from rollout_svc.protocol import SamplingParams
from workers.engine import MiB, VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

REPO_ROOT = Path(__file__).resolve().parents[2]
# float32 and the same settings on both sides: bf16 and batching change numerics, so greedy ids could differ.
ENGINE_SETTINGS = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_bytes": 256 * MiB, "max_num_seqs": 8}
MAX_TOKENS = 24
DIRECT_TIMEOUT_S = 200  # startup ~20 s, generation ~5 s: generous for a loaded 2-core host
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three prime numbers.",
]


def cpu_env() -> dict[str, str]:
    """The environment for an engine: on CPU, vLLM's default thread binding leaves a 2-core host half idle."""
    env = dict(os.environ)
    if len(os.sched_getaffinity(0)) >= 2:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    return env


def engine_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return prepare_model(Settings().cache_dir)  # Settings reads ROLLOUT_CACHE_DIR


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(str(model_dir), **ENGINE_SETTINGS)
    with pytest.MonkeyPatch.context() as env:  # the engine-core process inherits the environment at its start
        for name, value in cpu_env().items():
            env.setenv(name, value)
        await engine.start()
    yield engine
    await engine.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prompts(engine: VLLMEngine) -> list[list[int]]:
    return [await engine.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]


async def run_direct_cli(model_dir: Path, prompts: list[list[int]], tmp_path: Path) -> dict:
    """`python -m workers.direct --sequential` in a child process, killed if it overruns."""
    prompts_file, out_file = tmp_path / "prompts.json", tmp_path / "out.json"
    prompts_file.write_text(json.dumps(prompts))
    args = ["--model", str(model_dir), "--prompts-file", str(prompts_file), "--out", str(out_file), "--sequential"]
    args += ["--dtype", "float32", "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
    args += ["--max-model-len", "2048", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(256 * MiB)]
    child = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "workers.direct", *args],
        cwd=REPO_ROOT,
        env=cpu_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(child.communicate(), timeout=DIRECT_TIMEOUT_S)
    except TimeoutError:
        child.kill()
        output, _ = await child.communicate()
        pytest.fail(f"workers.direct ran past {DIRECT_TIMEOUT_S} s:\n{output.decode(errors='replace')[-4000:]}")
    finally:
        if child.returncode is None:  # the test itself was interrupted
            child.kill()
            await child.wait()
    assert child.returncode == 0, output.decode(errors="replace")[-4000:]
    return json.loads(out_file.read_text())


async def test_greedy_float32_is_token_identical_to_direct_vllm(
    engine: VLLMEngine, model_dir: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ours = [await engine.generate(f"greedy-{i}", prompt, params) for i, prompt in enumerate(prompts)]
    direct = await run_direct_cli(model_dir, prompts, tmp_path)

    assert [c.completion_token_ids for c in ours] == [o["completion_token_ids"] for o in direct["outputs"]]
    for prompt, completion, reference in zip(prompts, ours, direct["outputs"], strict=True):
        assert completion.prompt_token_ids == prompt
        assert completion.logprobs == pytest.approx(reference["logprobs"], abs=1e-5)
        assert len(completion.logprobs) == len(completion.completion_token_ids) > 0
        assert all(lp <= 0.0 for lp in completion.logprobs)
        assert completion.finish_reason in ("stop", "length")
        assert completion.text == await engine.detokenize(completion.completion_token_ids, True)
    assert direct["output_tokens"] == sum(len(c.completion_token_ids) for c in ours)
    assert direct["output_tokens_per_s"] > 0


async def test_prompt_longer_than_context_is_invalid_and_engine_serves_on(
    engine: VLLMEngine, prompts: list[list[int]]
) -> None:
    with pytest.raises(InvalidRequestError, match="maximum model length"):
        await engine.generate("too-long", [42] * 3000, SamplingParams(max_tokens=4))

    completion = await engine.generate("after", prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
    assert completion.finish_reason == "length"
    assert len(completion.completion_token_ids) == 4


async def test_seeded_requests_among_long_prompts_do_not_kill_the_engine(engine: VLLMEngine) -> None:
    # 8 prompts x 900 tokens overflow one step's 2048-token budget: with chunked prefill, vLLM 0.32 on CPU
    # died rewinding a seeded request's generator ("CPU Generator does not use offset").
    long_prompts = [[100 + (i * 7 + j) % 5000 for j in range(900)] for i in range(8)]
    params = SamplingParams(temperature=0.7, max_tokens=4, seed=0)
    done = await asyncio.gather(*(engine.generate(f"seeded-{i}", p, params) for i, p in enumerate(long_prompts)))
    assert all(len(c.completion_token_ids) == 4 for c in done)
    after = await engine.generate("seeded-after", long_prompts[0], params)  # the engine lives on
    assert len(after.completion_token_ids) == 4


async def test_cancelling_generate_aborts_the_request_in_vllm(engine: VLLMEngine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=1500, ignore_eos=True)
    task = asyncio.create_task(engine.generate("cancelled", prompts[1], params))
    async with asyncio.timeout(30):
        while engine.num_unfinished_requests() == 0:  # vLLM offers no event for "request admitted"
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_unfinished_requests() == 0


async def test_abort_ends_generate_with_finish_reason_abort(engine: VLLMEngine, prompts: list[list[int]]) -> None:
    task = asyncio.create_task(engine.generate("aborted", prompts[2], SamplingParams(max_tokens=1500, ignore_eos=True)))
    async with asyncio.timeout(30):
        while engine.num_unfinished_requests() == 0:
            await asyncio.sleep(0.01)
    await engine.abort("aborted")
    completion = await asyncio.wait_for(task, timeout=30)
    assert completion.finish_reason == "abort"
    assert len(completion.completion_token_ids) < 1500


async def test_a_repeated_prompt_reports_its_prefix_cache_hit(engine: VLLMEngine, prompts: list[list[int]]) -> None:
    prompt = [t for p in prompts for t in p] * 4  # a few hundred tokens: several KV blocks
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = await engine.generate("cached-1", prompt, params)
    second = await engine.generate("cached-2", prompt, params)
    assert first.cached_tokens < second.cached_tokens <= len(prompt)  # vLLM's num_cached_tokens, passed on
    assert second.cached_tokens >= len(prompt) // 2


async def test_chat_prompt_renders_the_user_message(engine: VLLMEngine) -> None:
    ids = await engine.chat_prompt([{"role": "user", "content": "Tell me about otters."}])
    text = await engine.detokenize(ids, skip_special_tokens=False)
    assert "Tell me about otters." in text
    assert text.endswith("<|im_start|>assistant\n")  # add_generation_prompt=True


async def test_tokenize_detokenize_round_trip(engine: VLLMEngine) -> None:
    text = "Rollouts for RL: 42 steps, ünïcödé ✓"
    ids = await engine.tokenize(text, add_special_tokens=False)
    assert ids and all(isinstance(i, int) for i in ids)
    assert await engine.detokenize(ids, skip_special_tokens=True) == text


async def test_close_leaves_no_engine_process(engine: VLLMEngine) -> None:
    # Runs last in this module: the fixture's own close after it is a no-op.
    before = engine_processes()
    assert before, "expected VLLM::EngineCore (and its worker) to be running"
    await engine.close()
    assert not [p for p in before if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
