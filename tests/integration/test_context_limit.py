"""A request longer than every live worker's context (`max_model_len`, from their heartbeats) is refused at
submission, through the Python client and over HTTP, and never reaches a worker; its neighbours are served."""

from __future__ import annotations

from pathlib import Path

import httpx

from rollout_svc import RolloutClient
from tests.support import serve

CONTEXT = 64  # tokens: the echo workers' --max-model-len


async def test_a_prompt_longer_than_every_workers_context_is_refused_at_submission(settings, echo_workers):
    echo_workers(1, "--max-model-len", str(CONTEXT))
    echo_workers(1, "--max-model-len", str(CONTEXT // 2))  # the longest context counts, not the shortest
    short, long = list(range(1, 11)), list(range(1, CONTEXT + 2))
    async with RolloutClient(settings) as client:
        assert sorted(w.max_model_len for w in await client.workers()) == [CONTEXT // 2, CONTEXT]
        batch = await client.generate([short, long, short], {"max_tokens": 4, "temperature": 0.0})
        assert [t.finish_reason for t in batch] == ["length", "error", "length"]
        assert batch[1].error_code == "invalid_request" and batch[1].worker_id == ""  # no worker took it
        assert f"{CONTEXT + 1} tokens" in batch[1].error and f"({CONTEXT} tokens" in batch[1].error
        # as long as the longest context: not refused here, but taken by a worker (which decides; echo refuses it)
        [at_limit] = await client.generate([long[:CONTEXT]], {"max_tokens": 1})
        assert at_limit.worker_id != ""


def test_over_http_the_refusal_is_a_400_naming_the_context(settings, echo_workers, tmp_path: Path):
    echo_workers(1, "--max-model-len", str(CONTEXT))
    with serve(settings, tmp_path / "serve.log", env={"ROLLOUT_API_KEYS": '["k"]'}) as base:
        headers = {"Authorization": "Bearer k"}
        body = {"model": "echo", "prompt": list(range(1, CONTEXT + 2)), "max_tokens": 4}
        answer = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=30)
        assert answer.status_code == 400, answer.text
        assert "max_model_len" in answer.json()["error"]["message"]
        body["prompt"] = list(range(1, 11))
        assert httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=30).status_code == 200
