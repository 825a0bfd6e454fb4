"""Between vLLM's records and ours: our sampling params as vLLM's, vLLM's request outputs as our `Completion`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_svc.errors import InvalidRequestError
from rollout_svc.protocol import PromptLogprob, SamplingParams
from workers.engine import Completion

if TYPE_CHECKING:  # vllm is imported lazily: a worker running EchoEngine must not pay its import
    from vllm import RequestOutput


def vllm_sampling_params(params: SamplingParams, delta: bool = False) -> Any:
    """Our SamplingParams (vLLM's field names) plus logprobs of the sampled tokens (and the top `logprobs`),
    reported once at the end, or with each step's new tokens (`delta`)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    fields = params.model_dump(exclude={"logprobs", "structured_outputs"})
    try:
        structured = params.structured_outputs
        return VLLMSamplingParams(
            **fields,
            logprobs=params.logprobs or 0,
            flat_logprobs=True,
            output_kind=kind,
            structured_outputs=StructuredOutputsParams(**structured.to_vllm()) if structured else None,
        )
    except (VLLMClientError, ValueError, TypeError) as exc:  # e.g. temperature > 2, which vLLM refuses
        raise InvalidRequestError(f"vLLM refused the sampling params: {exc}") from exc


def sampled_logprobs(output: Any) -> list[float]:
    """The logprob of each sampled token of a `vllm.CompletionOutput` asked for `logprobs=0, flat_logprobs=True`.

    With logprobs=0 vLLM returns one entry per position, the sampled token's, so the flat list is the answer.
    Shape: one float per `output.token_ids` entry. Raises `RuntimeError` if vLLM returned another shape.
    """
    flat = output.logprobs
    if flat is None or list(flat.token_ids) != list(output.token_ids):
        raise RuntimeError("vLLM returned no per-token logprobs of the sampled tokens; ask for logprobs=0")
    return list(flat.logprobs)


def prompt_logprobs_of(final: Any) -> list[list[PromptLogprob]]:
    """Per prompt position of a `vllm.RequestOutput` asked for `prompt_logprobs`: `(token id, text, logprob, rank)`
    of each entry vLLM gives (the prompt token's first, then the top k); none at position 0. Raises `RuntimeError`
    if vLLM returned none."""
    raw = final.prompt_logprobs
    if raw is None:
        raise RuntimeError("vLLM returned no prompt logprobs; ask for prompt_logprobs")
    return [
        [(int(t), lp.decoded_token or "", float(lp.logprob), int(lp.rank or 0)) for t, lp in position.items()]
        if position
        else []
        for position in raw
    ]


def top_logprobs(output: Any, k: int) -> tuple[list[float], list[list[tuple[int, str, float]]], list[str]]:
    """Per position of a `vllm.CompletionOutput` asked for `logprobs=k, flat_logprobs=True`: the sampled token's
    logprob, the top k `(token id, text, logprob)` by vLLM's rank (best first), and the sampled token's text.

    vLLM's flat layout holds, per position, the sampled token first, then the top k (a token in both appears
    once). Raises `RuntimeError` if vLLM returned another shape.
    """
    flat, ids = output.logprobs, list(output.token_ids)
    if flat is None or len(flat.start_indices) != len(ids):
        raise RuntimeError(f"vLLM returned no top-{k} logprobs per position")
    sampled, tops, texts = [], [], []
    for position, token_id in enumerate(ids):
        start, end = flat.start_indices[position], flat.end_indices[position]
        if flat.token_ids[start] != token_id:
            raise RuntimeError("vLLM's logprobs do not start with the sampled token")
        sampled.append(flat.logprobs[start])
        texts.append(flat.decoded_tokens[start] or "")
        ranked = sorted(
            (flat.ranks[j], flat.token_ids[j], flat.decoded_tokens[j] or "", flat.logprobs[j])
            for j in range(start, end)
            if flat.ranks[j] is not None and flat.ranks[j] <= k
        )
        tops.append([(t, text, lp) for _, t, text, lp in ranked[:k]])
    return sampled, tops, texts


# vLLM's finish reasons; "repetition" (its n-gram detector) is a kind of stop.
_FINISH_REASONS = {"stop": "stop", "repetition": "stop", "length": "length", "abort": "abort"}


def finish_reason_of(final: RequestOutput) -> str:
    """Our finish reason of vLLM's final output. `RuntimeError` for its "error" (a request-level failure)."""
    output = final.outputs[0]
    finish_reason = _FINISH_REASONS.get(str(output.finish_reason))
    if finish_reason is None:  # "error": a request-level failure inside vLLM (for example a KV transfer)
        raise RuntimeError(f"vLLM failed request {final.request_id} (finish reason {output.finish_reason})")
    return finish_reason


def completion_of(
    prompt_token_ids: list[int], final: RequestOutput, k: int | None, delta: bool = False, prompt_k: int | None = None
) -> Completion:
    """Our Completion of vLLM's final `RequestOutput` (n=1), or of one delta output (finish reason "": vLLM gives the
    prompt logprobs with the first)."""
    output = final.outputs[0]
    finish_reason = "" if delta else finish_reason_of(final)
    ids = list(output.token_ids)
    prompt = prompt_logprobs_of(final) if prompt_k is not None and final.prompt_logprobs is not None else None
    cached = final.num_cached_tokens or 0
    if k is None:
        logprobs = sampled_logprobs(output) if ids else []
        return Completion(
            prompt_token_ids, ids, logprobs, finish_reason, output.text, prompt_logprobs=prompt, cached_tokens=cached
        )
    logprobs, tops, texts = top_logprobs(output, k) if ids else ([], [], [])
    return Completion(prompt_token_ids, ids, logprobs, finish_reason, output.text, tops, texts, prompt, cached)
