"""Batch jobs on RQ (`rollout-svc batch ...`, `rollout-svc batch-worker`) and OpenAI's Batch API, on real echo workers
and a real redis-server: ShareGPT prompts, a batch worker killed with -9 halfway, cancel, failed lines."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from openai import OpenAI

from rollout_svc.config import Settings
from rollout_svc.tools import dataset
from tests.doc_examples import rollout_process
from tests.integration.test_api import KEY, serve
from tests.support import ROOT, settings_env, wait_until

CLI = [sys.executable, "-m", "rollout_svc"]


def write_batch(path: Path, count: int, max_tokens: int = 16, start: int = 0) -> list[str]:
    """A JSONL batch of ShareGPT first turns (chat completions); returns the custom_ids in order."""
    ids = []
    with open(path, "w") as out:
        for i, conversation in enumerate(dataset.first_turns(start + count, max_chars=400)[start:]):
            body = {"model": "echo", "messages": conversation, "max_tokens": max_tokens, "temperature": 0}
            ids.append(f"line-{start + i}")
            line = {"custom_id": ids[-1], "method": "POST", "url": "/v1/chat/completions", "body": body}
            out.write(json.dumps(line) + "\n")
    return ids


def read_output(path: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id appears twice in the output"
    return by_id


@contextlib.contextmanager
def batch_worker(settings: Settings, log: Path, *env_pairs: tuple[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """`rollout-svc batch-worker` in a session of its own; killed with its whole tree (RQ's work horse) on leaving."""
    env = {**settings_env(settings), **dict(env_pairs)}
    args = ["batch-worker", "--redis-url", settings.redis_url]
    # Killed: only a machine that stopped scheduling (as CI's once did) takes long to reap it.
    with rollout_process(args, env, log, stop_signal=signal.SIGKILL, stop_timeout_s=60) as proc:
        yield proc


def kill_tree(pid: int, sig: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)


def cli(settings: Settings, *args: str, timeout_s: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "batch", *args, "--redis-url", settings.redis_url],
        env=settings_env(settings),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def served(rds: redis.Redis, settings: Settings) -> int:
    """Generations the live workers ran (their heartbeats' `served`)."""
    return sum(
        int(rds.hget(settings.keys.worker(w.decode()), "served") or 0) for w in rds.smembers(settings.keys.workers)
    )


@pytest.mark.timeout(180)
def test_batch_worker_killed_halfway_loses_nothing_and_regenerates_nothing(settings, echo_workers, rds, tmp_path):
    """500 ShareGPT lines through 2 workers; the batch worker (and its work horse) killed with -9 halfway and started
    again: every custom_id once in the output, the lines finished before the kill untouched, 500 generations in all
    (the lines in flight at the kill were collected from the batch's results stream, not generated again)."""
    echo_workers(2, "--echo-token-delay-s", "0.01", "--max-num-seqs", "16")
    ids = write_batch(tmp_path / "in.jsonl", 500)
    out = tmp_path / "out.jsonl"
    with batch_worker(settings, tmp_path / "bw1.log") as first:
        submitted = cli(settings, "submit", str(tmp_path / "in.jsonl"), "-o", str(out))
        assert submitted.returncode == 0, submitted.stderr
        batch_id = submitted.stdout.split()[-1]
        key = settings.keys.batch(batch_id)
        wait_until(lambda: int(rds.hget(key, "completed") or 0) >= 250, 90, "half the batch", interval_s=0.05)
        kill_tree(first.pid, signal.SIGKILL)
    before = {k.decode(): v for k, v in rds.hgetall(settings.keys.batch_output(batch_id)).items()}
    assert 250 <= len(before) < 500, f"{len(before)} lines done at the kill"
    assert rds.hget(key, "status") == b"in_progress"
    with batch_worker(settings, tmp_path / "bw2.log"):
        wait_until(lambda: rds.hget(key, "status") == b"completed", 120, "the batch to complete", interval_s=0.2)
    output = read_output(out)
    assert sorted(output) == sorted(ids)
    assert all(line["error"] is None and line["response"]["status_code"] == 200 for line in output.values())
    assert all(line["response"]["body"]["choices"][0]["message"]["content"] for line in output.values())
    for custom_id, raw in before.items():  # recorded once: the resumed run did not answer them again
        assert json.loads(raw) == output[custom_id]
    wait_until(lambda: served(rds, settings) >= 500, 5, "the workers' heartbeats")
    assert served(rds, settings) == 500, "some line was generated twice"
    counts = rds.hmget(key, ["completed", "failed", "attempts"])
    assert counts[:2] == [b"500", b"0"] and int(counts[2]) >= 1
    log = (tmp_path / "bw2.log").read_text()
    assert "awaited from an earlier run" in log, log[-2000:]
    assert not rds.exists(settings.keys.results(f"batch-{batch_id}")), "the batch's results stream was left behind"


@pytest.mark.timeout(300)
def test_openai_batch_api_with_the_official_client(settings, echo_workers, tmp_path):
    """files.create, batches.create, batches.retrieve, files.content through `rollout-svc serve`; a bad line fails
    alone with its error; cancel; the CLI's `submit --wait` writes the same shape of output."""
    echo_workers(2, "--echo-token-delay-s", "0.02")  # the 200-token lines of the cancelled batch take 4 s
    ids = write_batch(tmp_path / "in.jsonl", 40, max_tokens=8)
    bad = {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "echo"}}
    with open(tmp_path / "in.jsonl", "a") as f:
        f.write(json.dumps(bad) + "\n")
    with batch_worker(settings, tmp_path / "bw.log"), serve(settings, tmp_path / "serve.log") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)
        file = client.files.create(file=(tmp_path / "in.jsonl").read_bytes(), purpose="batch")
        assert file.bytes == (tmp_path / "in.jsonl").stat().st_size
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 41

        def ended(batch_id: str, *statuses: str):
            current = client.batches.retrieve(batch_id)
            return current if current.status in statuses else None

        done = wait_until(lambda: ended(batch.id, "completed", "failed", "cancelled"), 180, "the batch", interval_s=0.2)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (40, 1)
        lines = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        assert [line["custom_id"] for line in lines] == [*ids, "bad"]  # input order
        failed = lines[-1]
        assert failed["response"]["status_code"] == 400 and "messages" in failed["error"]["message"]
        body = lines[0]["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "echo" and body["usage"]["completion_tokens"]

        # Errors in OpenAI's shape: an unknown file, a file with a bad line.
        with pytest.raises(Exception, match="upload it first"):
            client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
        wrong_url = b'{"custom_id": "x", "url": "/v1/embeddings", "body": {}}\n'
        broken = client.files.create(file=("b.jsonl", wrong_url), purpose="batch")
        with pytest.raises(Exception, match="line 1"):
            client.batches.create(input_file_id=broken.id, endpoint="/v1/chat/completions", completion_window="24h")

        # Cancel: a slow batch is cancelled; what finished stays in its output.
        write_batch(tmp_path / "slow.jsonl", 200, max_tokens=200)
        slow = client.files.create(file=(tmp_path / "slow.jsonl").read_bytes(), purpose="batch")
        running = client.batches.create(input_file_id=slow.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_until(lambda: client.batches.retrieve(running.id).status == "in_progress", 30, "the slow batch to start")
        assert client.batches.cancel(running.id).status in ("cancelling", "cancelled")
        cancelled = wait_until(lambda: ended(running.id, "cancelled"), 30, "the cancel", interval_s=0.2)
        assert cancelled.request_counts.completed < 200
        kept = client.files.content(cancelled.output_file_id).text.splitlines()
        assert len(kept) == cancelled.request_counts.completed + cancelled.request_counts.failed

        # The CLI on the same fleet.
        out = tmp_path / "cli-out.jsonl"
        waited = cli(settings, "submit", str(tmp_path / "in.jsonl"), "-o", str(out), "--wait", timeout_s=90)
        assert waited.returncode == 0, waited.stdout + waited.stderr
        assert "completed, 40 of 41 completed, 1 failed" in waited.stdout
        assert "batch " in waited.stdout and "41" in waited.stdout  # progress lines (stdout is a pipe here)
        assert sorted(read_output(out)) == sorted([*ids, "bad"])
        [batch_id] = re.findall(r"as batch (batch_\w+)", waited.stdout)
        status = cli(settings, "status", "--json", batch_id)
        assert status.returncode == 0 and json.loads(status.stdout)["status"] == "completed", status


def test_a_batch_with_no_batch_worker_says_so_and_cancels_at_once(settings, tmp_path):
    """Submitted with no batch worker running: a warning saying what to start, the id as the last word; cancelled
    before any run started, it is `cancelled` at once, and a bad file is refused naming its line."""
    write_batch(tmp_path / "in.jsonl", 3)
    submitted = cli(settings, "submit", str(tmp_path / "in.jsonl"))
    assert submitted.returncode == 0 and "no batch worker is running" in submitted.stderr, submitted
    batch_id = submitted.stdout.split()[-1]
    assert batch_id.startswith("batch_")
    cancelled = cli(settings, "cancel", batch_id)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled
    status = cli(settings, "status", batch_id, "--json")
    assert json.loads(status.stdout)["status"] == "cancelled"
    (tmp_path / "bad.jsonl").write_text('{"custom_id": "a", "url": "/v1/chat/completions", "body": {}}\nnot json\n')
    refused = cli(settings, "submit", str(tmp_path / "bad.jsonl"))
    assert refused.returncode == 1 and "line 2 is not JSON" in refused.stderr, refused
    again = cli(settings, "cancel", batch_id)
    assert again.returncode == 1 and "already cancelled" in again.stderr, again
