"""vLLM's token-in, token-out protocol (`POST /inference/v1/generate`), without HTTP: what SkyRL's
`RemoteInferenceClient.generate` and `.sample` send, as rollout requests, and trajectories as vLLM answers.

Source: vLLM 0.32's `vllm/entrypoints/scale_out/token_in_token_out/protocol.py` (`GenerateRequest`,
`GenerateResponse`), the server SkyRL 0.3.0's `vllm_server_actor.py` runs. Request body::

    {"token_ids": [int, ...], "sampling_params": {vLLM's SamplingParams fields}, "model": str | None,
     "request_id": str | None, "cache_salt": str | None, "stream": false, "return_token_ids": bool | None}

Response (`output_mode` "tokens", the only one served)::

    {"request_id", "model", "created", "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
     "prompt_logprobs": [None, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...] | None,
     "prompt_token_ids": [int] | None,
     "choices": [{"index", "finish_reason": "stop" | "length" | "abort", "stop_reason": None, "token_ids": [int],
                  "logprobs": {"content": [{"token_id", "logprob", "top_logprobs": [{"token_id", "logprob"}]}]}
                              | None,
                  "weight_versions": [{"version": str, "start": int, "end": int}], "worker_id": str}],
     "weight_version": int}

`sampling_params` is lenient where vLLM is: a field set to None is unset (SkyRL's defaults send `"stop": None`), and
a field we do not implement is accepted at vLLM's default value and refused, by name, at any other. `n` makes n
requests of one group (choice j seeded `seed + j`, as `RolloutClient.sample`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import ValidationError

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.errors import GenerationError
from rollout_svc.integrations.skyrl.shapes import GenerateBody
from rollout_svc.openai.errors import APIError
from rollout_svc.openai.plans import chat_plan
from rollout_svc.openai.schemas import ChatCompletionRequest, check_wire_ints
from rollout_svc.protocol import SamplingParams, Trajectory

# vLLM SamplingParams fields we implement, by our name (the same as vLLM's).
_OURS = set(SamplingParams.model_fields)
# vLLM fields that change nothing in a non-streamed token response, or that only say what we do anyway: accepted
# with any value. (`output_kind`: cumulative or final-only streaming; `detokenize`: text we do not return.)
_NO_EFFECT = {"output_kind", "detokenize", "stream_interval", "skip_clone", "spaces_between_special_tokens"}
# vLLM fields we do not implement, with vLLM's default: accepted at it (or None), refused, by name, otherwise.
_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "best_of": None,
    "watermarking": None,
    "prompt_logprob_token_ids": None,
    "prompt_logprob_start": None,
    "logprob_token_ids": None,
    "flat_logprobs": False,
    "output_text_buffer_length": 0,
    "logit_bias": None,
    "allowed_token_ids": None,
    "extra_args": None,
    "bad_words": None,
    "skip_reading_prefix_cache": None,
    "thinking_token_budget": None,
    "repetition_detection": None,
    "routed_experts_prompt_start": 0,
    "trace_decode_token_ids": None,
    "logits_processors": None,
    "truncate_prompt_tokens": None,
    "guided_decoding": None,
}


def generate_params(body: GenerateBody) -> tuple[SamplingParams, int]:
    """Our `SamplingParams` and `n` of a generate body. Raises `APIError` 400 naming what is refused: a field we
    do not implement set to other than vLLM's default, an unknown field, a bad value, a streamed or multimodal
    request."""
    for name, value, allowed in (
        ("stream", body.stream, (False, None)),
        ("output_mode", body.output_mode, ("tokens",)),
        ("priority", body.priority, (0,)),
        ("features", body.features, (None,)),
        ("kv_transfer_params", body.kv_transfer_params, (None,)),
    ):
        if value not in allowed:
            raise APIError(400, f"{name}={value!r} is not served here (only {allowed[0]!r})", param=name)
    return vllm_sampling_params(body.sampling_params)


def vllm_sampling_params(sampling_params: dict[str, Any]) -> tuple[SamplingParams, int]:
    """Our `SamplingParams` and `n` of vLLM's sampling params (a dict, as SkyRL sends them). Raises `APIError` 400
    naming what is refused: a field we do not implement set to other than vLLM's default, an unknown field, a bad
    value."""
    try:
        check_wire_ints("sampling_params", sampling_params)
    except ValueError as exc:
        raise APIError(400, str(exc), param="sampling_params") from exc
    fields: dict[str, Any] = {}
    n = 1
    for name, value in sampling_params.items():
        if value is None:
            continue  # unset: our default, as vLLM's dataclass default where a field is absent
        if name == "n":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise APIError(400, "sampling_params.n must be a positive integer", param="sampling_params.n")
            n = value
        elif name in _OURS:
            fields[name] = [value] if name == "stop" and isinstance(value, str) else value
        elif name in _NO_EFFECT:
            continue
        elif name in _DEFAULTS:
            if value != _DEFAULTS[name]:
                raise APIError(
                    400,
                    f"sampling_params.{name}={value!r} is not implemented by rollout-svc (leave it unset or "
                    f"{_DEFAULTS[name]!r})",
                    param=f"sampling_params.{name}",
                )
        else:
            param = f"sampling_params.{name}"
            raise APIError(400, f"{param} is not a vLLM sampling parameter", param=param)
    try:
        return SamplingParams.model_validate(fields), n
    except ValidationError as exc:
        error = exc.errors()[0]
        param = "sampling_params." + ".".join(str(p) for p in error.get("loc", ()))
        raise APIError(400, f"{param}: {error.get('msg')}", param=param) from exc


async def render_chat(
    client: RolloutClient, body: ChatCompletionRequest, model: str, session_id: str | None, default_max_tokens: int
) -> dict[str, Any]:
    """vLLM's render of a chat request: the `/inference/v1/generate` body that would run it (vLLM's
    `GenerateRequest`: the prompt's token ids under the workers' chat template, its sampling params), without
    generating. Text only (`features` None). Raises `APIError` 400 for a bad request or one the template refuses."""
    plan = chat_plan(body, model, session_id, default_max_tokens)
    try:
        [ids] = await client.apply_chat_template(
            [plan.prompts[0]],  # type: ignore[list-item]  # a chat plan's prompts are conversations
            tools=plan.tools,
            chat_template_kwargs=plan.chat_template_kwargs,
        )
    except (GenerationError, ValueError) as exc:
        raise APIError(400, str(exc)) from exc
    params = plan.params[0].model_dump(mode="json", by_alias=True, exclude_none=True)
    return {
        "request_id": f"chatcmpl-{plan.reply.id}",
        "token_ids": ids,
        "features": None,
        "sampling_params": {**params, "n": body.n, **({"seed": body.seed} if body.seed is not None else {})},
        "model": model,
        "stream": False,
        "cache_salt": None,
    }


def group_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling params of n samples of one prompt: sample j seeded `seed + j` where a seed is given."""
    if params.seed is None:
        return [params] * n
    return [params.model_copy(update={"seed": params.seed + j}) for j in range(n)]


def generate_response(
    body: GenerateBody, model: str, trajectories: list[Trajectory], request_id: str | None = None
) -> dict[str, Any]:
    """vLLM's `GenerateResponse` (tokens mode) for the trajectories of one generate body, choice j = sample j."""
    prompt = len(body.token_ids)
    completion = sum(len(t.completion_token_ids) for t in trajectories)
    logprobs = body.sampling_params.get("logprobs") is not None
    return {
        "request_id": request_id or body.request_id or uuid.uuid4().hex,
        "model": model,
        "created": int(time.time()),
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        "prompt_logprobs": vllm_prompt_logprobs(trajectories[0]) if trajectories else None,
        "prompt_token_ids": list(body.token_ids) if body.return_token_ids else None,
        "choices": [_choice(j, t, logprobs) for j, t in enumerate(trajectories)],
        "weight_version": min((t.weight_version for t in trajectories), default=0),
    }


def vllm_prompt_logprobs(t: Trajectory) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` of a response: per prompt position, None at 0, then `{token id (a string):
    {"logprob", "rank", "decoded_token"}}`, the prompt token's entry first (vLLM's `Logprob` as its server dumps
    it). None where the request did not ask for them."""
    if t.prompt_logprobs is None:
        return None
    return [
        {str(tid): {"logprob": logprob, "rank": rank, "decoded_token": text} for tid, text, logprob, rank in row}
        if i
        else None
        for i, row in enumerate(t.prompt_logprobs)
    ]


def _choice(index: int, t: Trajectory, logprobs: bool) -> dict[str, Any]:
    content = None
    if logprobs:
        tops = t.top_logprobs or [[] for _ in t.completion_token_ids]
        content = [
            {
                "token_id": token,
                "logprob": logprob,
                "top_logprobs": [{"token_id": top[0], "logprob": top[2]} for top in top_k],
            }
            for token, logprob, top_k in zip(t.completion_token_ids, t.logprobs, tops, strict=True)
        ]
    return {
        "index": index,
        "finish_reason": t.finish_reason,
        "stop_reason": None,
        "token_ids": t.completion_token_ids,
        "logprobs": {"content": content} if logprobs else None,
        "weight_versions": weight_version_spans(t),
        "worker_id": t.worker_id,  # ours: the engine that generated it (vLLM's answer has no such field)
    }


def weight_version_spans(t: Trajectory) -> list[dict[str, Any]]:
    """vLLM's `WeightVersionSpan`s of a trajectory: output tokens `[start, end)` sampled by weights `version`
    (a string, as vLLM's), from our `(version, first_token_index)` pairs."""
    total = len(t.completion_token_ids)
    spans = list(t.weight_versions) or [(t.weight_version, 0)]
    out = []
    for i, (version, start) in enumerate(spans):
        end = spans[i + 1][1] if i + 1 < len(spans) else total
        out.append({"version": str(version), "start": start, "end": end})
    return out
