"""The OpenAI API rides out a worker killed under load, as a user saw it fail: two vLLM workers behind `serve`, 120
chats from the official `openai` client, each listing the models first (`client.models.list().data[0].id`, the
usual agent code), one worker killed with -9 once 20 chats are done and started again (as `up` restarts it), and
the other stopped (SIGSTOP) past its heartbeat TTL meanwhile, as a starved heartbeat would make it look: for a while
no worker is live (before this was fixed, `/v1/models` answered an empty list then, and requests a 503), yet every
chat completes. Meanwhile it samples the live workers every 0.2 s and prints how long the fleet had none, and the
longest silence of each worker's heartbeat (what made a live worker look dead while its replacement started).
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import redis
from openai import OpenAI

from rollout_svc.config import EngineSettings, Settings
from rollout_svc.model import prepare_model
from tests.integration.test_api import KEY, serve
from tests.support import vllm_workers, wait_until

pytestmark = pytest.mark.vllm
MiB = 1024 * 1024
CHATS, KILL_AFTER, THREADS = 120, 20, 16


@pytest.mark.timeout(1800)
def test_120_chats_that_list_the_models_first_ride_out_a_worker_killed_under_load(redis_url: str, tmp_path: Path):
    settings = Settings(redis_url=redis_url, key_prefix=f"kill-{uuid.uuid4().hex[:6]}")  # the default heartbeats
    model_dir = prepare_model(settings.cache_dir)
    engine = EngineSettings(model=str(model_dir), dtype="float32", max_num_seqs=16, kv_cache_memory_bytes=256 * MiB)
    rds = redis.Redis.from_url(redis_url)
    live_log: list[tuple[float, int]] = []
    beats: dict[str, list[float]] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            now = time.monotonic()
            ids = [w.decode() for w in rds.smembers(settings.keys.workers)]
            live = [w for w in ids if rds.exists(settings.keys.worker(w))]
            live_log.append((now, len(live)))
            for w in live:
                beat = rds.hget(settings.keys.worker(w), "heartbeat_at")
                if beat is not None and (not beats.get(w) or beats[w][-1] != float(beat)):
                    beats.setdefault(w, []).append(float(beat))
            time.sleep(0.2)

    with vllm_workers(settings, engine, tmp_path) as procs, serve(settings, tmp_path / "serve.log") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=900)

        def chat(i: int) -> str:
            model = client.models.list().data[0].id
            messages = [{"role": "user", "content": f"Tell me one fact about the number {i}."}]
            answer = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
            return str(answer.choices[0].finish_reason)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with ThreadPoolExecutor(THREADS) as pool:
            futures = [pool.submit(chat, i) for i in range(CHATS)]
            wait_until(lambda: sum(f.done() for f in futures) >= KILL_AFTER, 900, f"{KILL_AFTER} chats done")
            killed_worker = procs.procs["vllm-1"]
            procs.kill("vllm-1")
            killed_worker.wait()
            killed = time.monotonic()
            procs.kill("vllm-0", signal.SIGSTOP)  # looks dead once its heartbeat expires
            try:
                time.sleep(settings.heartbeat_ttl_s + 2)
            finally:
                procs.kill("vllm-0", signal.SIGCONT)
            procs.start("vllm-1", *engine.to_args(), env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
            wait(futures)
        stop.set()
        sampler.join()
        errors = [repr(f.exception()) for f in futures if f.exception() is not None]
        none_live_s = sum(later - at for (at, n), (later, _) in itertools.pairwise(live_log) if n == 0 and at > killed)
        gaps = {w: max((b - a for a, b in itertools.pairwise(ts)), default=0.0) for w, ts in beats.items()}
        print(
            f"\nchats {CHATS - len(errors)}/{CHATS}; no live worker for {none_live_s:.1f} s after the kill; "
            f"longest heartbeat gap per worker (s): {gaps}"
        )
        assert errors == [], errors[:5]
        assert none_live_s > 0, "the fleet never had a moment without a live worker: the test did not test that"
