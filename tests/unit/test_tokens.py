"""vLLM's token-in, token-out protocol without HTTP: sampling params as vLLM takes them, and vLLM's response shape."""

from __future__ import annotations

import pytest

from rollout_svc.api.skyrl.records import DetokenizedTexts
from rollout_svc.integrations.skyrl.shapes import GenerateBody
from rollout_svc.integrations.skyrl.tokens import generate_params, generate_response, group_params
from rollout_svc.openai.errors import APIError
from rollout_svc.protocol import Trajectory


def body(**params: object) -> GenerateBody:
    return GenerateBody.model_validate({"token_ids": [1, 2, 3], "sampling_params": params})


def test_none_is_unset_and_vllm_defaults_of_unserved_fields_pass():
    params, n = generate_params(body(stop=None, seed=None, max_tokens=None, temperature=0.5, logit_bias=None, n=None))
    assert (params.stop, params.seed, params.max_tokens, params.temperature, n) == ([], None, 16, 0.5, 1)
    params, n = generate_params(body(stop="x", n=3, output_kind=2, detokenize=False, prompt_logprobs=None))
    assert params.stop == ["x"] and n == 3 and params.prompt_logprobs is None
    assert generate_params(body(prompt_logprobs=0))[0].prompt_logprobs == 0  # the sampled token's only, as vLLM


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"logit_bias": {"1": 2.0}}, "sampling_params.logit_bias"),
        ({"allowed_token_ids": [1]}, "sampling_params.allowed_token_ids"),
        ({"prompt_logprobs": 21}, "sampling_params.prompt_logprobs"),
        ({"no_such": 1}, "sampling_params.no_such"),
        ({"n": 0}, "sampling_params.n"),
        ({"temperature": -1}, "sampling_params.temperature"),
    ],
)
def test_what_is_not_served_is_refused_by_name(params, named):
    with pytest.raises(APIError) as refused:
        generate_params(body(**params))
    assert refused.value.status == 400 and refused.value.param == named


def test_a_streamed_or_multimodal_request_is_refused():
    for extra in ({"stream": True}, {"features": {"mm_hashes": {}}}):
        with pytest.raises(APIError, match=next(iter(extra))):
            generate_params(GenerateBody.model_validate({"token_ids": [1], **extra}))


def test_n_samples_are_seeded_apart():
    params, n = generate_params(body(n=3, seed=10))
    assert [p.seed for p in group_params(params, n)] == [10, 11, 12]
    assert group_params(generate_params(body(n=2))[0], 2)[1].seed is None


def test_the_response_has_vllms_shape_and_weight_spans():
    t = Trajectory(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[7, 8, 9],
        logprobs=[-0.5, -1.0, -0.25],
        finish_reason="length",
        weight_version=2,
        weight_versions=[(1, 0), (2, 2)],
        worker_id="w0",
    )
    out = generate_response(body(logprobs=0), "m", [t], "ext-1")
    [choice] = out["choices"]
    assert out["request_id"] == "ext-1" and out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
    }
    assert choice["token_ids"] == [7, 8, 9] and choice["finish_reason"] == "length"
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [-0.5, -1.0, -0.25]
    assert choice["weight_versions"] == [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 3}]
    assert generate_response(body(), "m", [t])["choices"][0]["logprobs"] is None


def trajectory(ids: list[int], text: str, finish_reason: str = "stop") -> Trajectory:
    return Trajectory(
        request_id="r",
        prompt_token_ids=[1],
        completion_token_ids=ids,
        logprobs=[0.0] * len(ids),
        text=text,
        finish_reason=finish_reason,
        weight_version=0,
        worker_id="w0",
    )


def test_a_completions_text_is_taken_once_per_completion_by_model():
    texts = DetokenizedTexts(capacity=2)
    texts.put("m", [trajectory([5, 6], "ab"), trajectory([5, 6], "ab"), trajectory([7], "c", "abort")])
    assert texts.take("other", [5, 6]) is None  # another model's tokenizer may differ
    assert [texts.take("m", [5, 6]) for _ in range(3)] == ["ab", "ab", None]  # two equal completions, asked twice
    assert texts.take("m", [7]) is None  # an aborted one is not kept: it is retried or was cut
    texts.put("m", [trajectory([1], "x"), trajectory([2], "y"), trajectory([3], "z")])
    assert texts.take("m", [1]) is None and texts.take("m", [3]) == "z"  # the oldest went first
