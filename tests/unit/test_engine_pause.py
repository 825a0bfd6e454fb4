"""The vLLM engine's pause returns once vLLM's output handler has processed every output of the steps before it
(workers/vllm_engine.py `_outputs_processed`, in place of vLLM's fixed 20 ms sleep): a weight sync reads each kept
request's token count right after the pause, and a count short by the outputs still queued would put tokens made
under the old weights in the new version's span. Here the engine-core client's queue and the output handler are
stand-ins shaped as in vLLM 0.32 (an `asyncio.Queue` the handler awaits); tests/e2e/test_weight_sync_vllm.py runs
the real engine's version spans."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import workers.vllm_engine
from workers.vllm_engine import _outputs_processed


def test_the_pause_returns_once_every_queued_output_is_processed_not_before():
    async def run() -> tuple[int, int]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        processed: list[int] = []

        async def handler() -> None:  # vLLM's output_handler: get, process (with awaits inside), repeat
            while True:
                item = await queue.get()
                for _ in range(3):  # a chunk boundary, an abort of stop-string requests
                    await asyncio.sleep(0)
                time.sleep(0.01)  # a loaded host: 50 ms in all, where vLLM's fixed 20 ms saw 2 of 5 processed
                processed.append(item)

        task = asyncio.create_task(handler())
        await asyncio.sleep(0)
        for item in range(5):  # the last steps' outputs, queued before the pause's reply
            queue.put_nowait(item)
        await _outputs_processed(SimpleNamespace(engine_core=SimpleNamespace(outputs_queue=queue), output_handler=task))
        seen = len(processed)
        task.cancel()
        return seen, queue.qsize()

    assert asyncio.run(run()) == (5, 0)


def test_an_idle_handler_lets_the_pause_return_at_once_and_an_unknown_client_waits_as_vllm_does():
    async def run() -> tuple[bool, bool]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        task = asyncio.create_task(queue.get())  # the handler, waiting for outputs that are not there
        await asyncio.sleep(0)
        ran: list[str] = []
        other = asyncio.create_task(asyncio.sleep(0, result=None))
        other.add_done_callback(lambda _: ran.append("other"))
        handler = SimpleNamespace(done=lambda: False)
        await _outputs_processed(
            SimpleNamespace(engine_core=SimpleNamespace(outputs_queue=queue), output_handler=handler)
        )
        idle_yielded = bool(ran)  # it returned without giving the loop a turn: no sleep at all
        await _outputs_processed(SimpleNamespace(engine_core=SimpleNamespace()))  # no queue to watch: vLLM's sleep
        unknown_yielded = bool(ran)
        task.cancel()
        return idle_yielded, unknown_yielded

    assert asyncio.run(run()) == (False, True)


def test_before_the_first_request_there_is_no_output_handler_and_nothing_to_wait_for():
    async def run() -> bool:
        queue: asyncio.Queue[int] = asyncio.Queue()
        ran: list[str] = []
        other = asyncio.create_task(asyncio.sleep(0, result=None))
        other.add_done_callback(lambda _: ran.append("other"))
        await _outputs_processed(SimpleNamespace(engine_core=SimpleNamespace(outputs_queue=queue), output_handler=None))
        yielded = bool(ran)
        await other
        return yielded

    assert asyncio.run(run()) is False


def test_a_handler_that_never_goes_idle_holds_the_pause_only_for_the_bound(monkeypatch, caplog):
    monkeypatch.setattr(workers.vllm_engine, "OUTPUTS_DRAIN_MAX_S", 0.2)

    async def run() -> float:
        queue: asyncio.Queue[int] = asyncio.Queue()
        queue.put_nowait(1)  # an output its handler never gets to: stuck in something else
        handler = SimpleNamespace(done=lambda: False)
        started = time.monotonic()
        llm = SimpleNamespace(engine_core=SimpleNamespace(outputs_queue=queue), output_handler=handler)
        await _outputs_processed(llm)
        return time.monotonic() - started

    waited = asyncio.run(run())
    assert 0.2 <= waited < 1.0
    assert "still busy 0.2 s after a pause" in caplog.text
