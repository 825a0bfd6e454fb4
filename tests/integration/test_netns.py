"""Hosts that fail, on one machine: network namespaces as hosts, one of them cut off the network (issue 9).

Four namespaces, each joined by a veth pair to a bridge of this test's own: Redis on one, an echo worker on each of
two more, the client on the fourth; every address is in a private /24 that only the bridge carries. With 400
requests in flight, one worker host is cut off from Redis (the bridge drops their frames silently: no reset, no
carrier lost, as in a partition) until its heartbeat has expired and the other worker has requeued its requests.
Then the link comes back: the cut worker's heartbeat is refused, it fences (publishes nothing for the requests that
moved) and rejoins as `{id}~1`. Two lengths of cut:

- `past-ttl` (TTL + 2 s = 5 s): shorter than the sockets' timeout, so what the cut worker sent meanwhile (a heartbeat
  renewal, results with their acks) waits in TCP retransmission and reaches Redis late, after the reap: the renewal
  is refused and the results are dropped by the publish script's XACK fence.
- `past-socket-timeout` (15 s): past TCP keepalive (an idle connection is declared dead after ~8 s) and the sockets'
  10 s timeout, so the cut worker's connections die and are made anew once the link is back. This case found that
  redis-py's `get_message` spins on a subscription whose connection died of ETIMEDOUT (`connect.next_message`).

The client runs inside its namespace (`python -m tests.integration.test_netns CUT_WORKER OTHER_WORKER`, Redis URL in
`ROLLOUT_REDIS_URL`) and talks to the test over its stdin and stdout: it says `cut-me` once both workers hold
requests, hears `cut`, says `reaped` once the cut worker's heartbeat expired and its requests were requeued, hears
`restored`, and prints `summary {...}`, which the test asserts on. It needs root and `ip netns` (skipped otherwise);
everything it creates is removed at teardown, failed or not.

The bridge lives in a fifth namespace, the switch, not in the root namespace. Frames a bridge forwards pass the
iptables FORWARD chain of the bridge's own namespace (br_netfilter, which Docker loads; `bridge-nf-call-iptables` is 1
in every namespace), and a Docker engine sets the root namespace's FORWARD policy to DROP: with the bridge there, the
workers timed out connecting to Redis. A fresh namespace has no rules and accepts everything, so the test adds no
firewall rules and needs no iptables binary, and nothing of the root namespace (interfaces, routes, firewall) can
reach the hosts' traffic or clash with it; that is also why the subnet can be fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from rollout_svc.connections.urls import SOCKET_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_TTL_S = 3.0
HEARTBEAT_INTERVAL_S = 0.5
CAPACITY = 64  # per worker: of the 400 requests at most 128 run at once, the rest wait in the queue
TOKENS = 48  # x 50 ms per token: 2.4 s per generation, so nothing has finished when the link is cut
TOKEN_DELAY_S = 0.05
REQUESTS = 400
REJOIN_REQUESTS = 2 * CAPACITY  # more than the other worker holds at once: the rejoined one must take some
CUTS_S = {"past-ttl": HEARTBEAT_TTL_S + 2, "past-socket-timeout": SOCKET_TIMEOUT_S + 5}  # and until the reap
REJOIN_TIMEOUT_S = SOCKET_TIMEOUT_S + 15  # after the link is back (a command sent while cut may time out first)
CUT_WORKER, OTHER_WORKER = "w1", "w2"
HOSTS = ("redis", CUT_WORKER, OTHER_WORKER, "client")
REDIS_PORT = 6379
STEP_TIMEOUT_S = 30.0  # every wait on the other side (a line, a process, a command) gives up after this


# --- the test's side: namespaces, processes, the conversation with the client ---------------------------------------


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `ip ARGS` (bounded); raises CalledProcessError with its stderr if `check` and it failed."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, ["ip", *args], result.stdout, result.stderr)
    return result


SUBNET = ipaddress.IPv4Network("10.213.0.0/24")  # reachable only inside the test's namespaces: no clash possible
SWITCH = "switch"  # the namespace that holds the bridge


@dataclass
class Hosts:
    """Namespaces `rsvc-{tag}-{host}`, each with `eth0` at an address of SUBNET, and the switch namespace
    `rsvc-{tag}-switch` whose bridge `br0` joins them, a port per host named after the host."""

    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def namespace(self, host: str) -> str:
        return f"rsvc-{self.tag}-{host}"

    def address(self, host: str) -> str:
        return str(SUBNET[HOSTS.index(host) + 1])

    def switch(self, *args: str) -> None:
        """Run `ip ARGS` inside the switch namespace."""
        ip("-n", self.namespace(SWITCH), *args)

    def create(self) -> None:
        ip("netns", "add", self.namespace(SWITCH))
        self.switch("link", "add", "br0", "type", "bridge")
        self.switch("link", "set", "br0", "up")
        for host in HOSTS:
            ns = self.namespace(host)
            ip("netns", "add", ns)
            self.switch("link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.switch("link", "set", host, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.address(host)}/{SUBNET.prefixlen}", "dev", "eth0")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", "eth0", "up")

    def cut(self, host: str) -> None:
        """The bridge stops forwarding between `host` and Redis: both ports isolated (isolated ports do not talk to
        each other). Frames are dropped silently, every carrier stays up: no reset, no local error."""
        for port in (host, "redis"):
            self.switch("link", "set", port, "type", "bridge_slave", "isolated", "on")

    def restore(self, host: str) -> None:
        for port in (host, "redis"):
            self.switch("link", "set", port, "type", "bridge_slave", "isolated", "off")

    def start(self, host: str, command: list[str], log: Path, **popen: Any) -> subprocess.Popen[bytes]:
        """Run `command` inside `host`'s namespace, stdout and stderr (unless given) to `log`."""
        with open(log, "wb") as out:  # the child keeps its own descriptor
            popen.setdefault("stdout", out)
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace(host), *command],
                stderr=out,
                cwd=ROOT,
                start_new_session=True,
                **popen,
            )
        self.procs.append(proc)
        return proc

    def destroy(self) -> None:
        """Kill every process in the namespaces (started here or not), delete them: each takes its interfaces along
        (the bridge, and both ends of every veth pair)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for host in HOSTS:
            for pid in ip("netns", "pids", self.namespace(host), check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STEP_TIMEOUT_S)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        for host in (*HOSTS, SWITCH):
            ip("netns", "delete", self.namespace(host), check=False)

    def leftovers(self) -> list[str]:
        """Namespaces of this tag still present, and interfaces of this tag in the root namespace (none after
        `destroy`; the test makes none there)."""
        names = ip("netns", "list", check=False).stdout.split() + ip("-o", "link", "show", check=False).stdout.split()
        return sorted({name.rstrip(":").split("@")[0] for name in names if f"-{self.tag}" in name})


def skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces, veth pairs and a bridge (run as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt install iproute2)"
    if shutil.which("redis-server") is None:
        return "needs redis-server on PATH"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable here: {probe.stderr.strip()}"
    return None


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    made = Hosts()
    try:
        try:
            made.create()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create network namespaces here ({' '.join(exc.cmd)}: {exc.stderr.strip()})")
        yield made
    finally:
        made.destroy()
        assert not made.leftovers(), f"teardown left {made.leftovers()}"


class Lines:
    """A child's stdout, line by line, read by a thread so that every wait has a deadline."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.seen: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[bytes]) -> None:
        for raw in stream:
            self._lines.put(raw.decode(errors="replace").rstrip("\n"))
        self._lines.put(None)

    def expect(self, word: str, timeout_s: float) -> str:
        """The first line starting with `word`; AssertionError naming what came instead after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {word!r} from the client within {timeout_s} s; it said {self.seen}") from None
            if line is None:
                raise AssertionError(f"the client exited before saying {word!r}; it said {self.seen}")
            self.seen.append(line)
            if line.startswith(word):
                return line


def log_tails(log_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(log_dir.glob("*.log")))


def rollout_env(hosts: Hosts) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")},
        "ROLLOUT_REDIS_URL": f"redis://{hosts.address('redis')}:{REDIS_PORT}/0",
        "ROLLOUT_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S),
        "ROLLOUT_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S),
        "ROLLOUT_REQUEST_TIMEOUT_S": "120",
    }


def start_cluster(hosts: Hosts, log_dir: Path) -> None:
    """Redis, then the two workers (the workers wait for Redis; the client waits for the workers)."""
    redis_args = ["--bind", hosts.address("redis"), "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no"]
    redis_args += ["--protected-mode", "no", "--dir", str(log_dir)]
    hosts.start("redis", ["redis-server", *redis_args], log_dir / "redis.log")
    for worker_id in (CUT_WORKER, OTHER_WORKER):
        args = ["--worker-id", worker_id, "--engine", "echo", "--max-num-seqs", str(CAPACITY)]
        args += ["--echo-token-delay-s", str(TOKEN_DELAY_S)]
        command = [sys.executable, "-m", "workers", *args]
        hosts.start(worker_id, command, log_dir / f"{worker_id}.log", env=rollout_env(hosts))


def run_client(hosts: Hosts, log_dir: Path, cut_s: float) -> dict[str, Any]:
    """Start the client in its namespace, cut and restore the worker's link when it asks, return its summary."""
    command = [sys.executable, "-m", "tests.integration.test_netns", CUT_WORKER, OTHER_WORKER]
    client = hosts.start(
        "client",
        command,
        log_dir / "client.log",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=rollout_env(hosts),
    )
    assert client.stdin is not None and client.stdout is not None
    lines = Lines(client.stdout)

    def tell(word: str) -> None:
        assert client.stdin is not None
        client.stdin.write(f"{word}\n".encode())
        client.stdin.flush()

    lines.expect("cut-me", 60)  # four processes start on 2 cores: imports take a while
    hosts.cut(CUT_WORKER)
    cut_at = time.monotonic()
    try:
        tell("cut")
        lines.expect("reaped", HEARTBEAT_TTL_S + STEP_TIMEOUT_S)
        time.sleep(max(0.0, cut_at + cut_s - time.monotonic()))  # the cut's length
    finally:
        hosts.restore(CUT_WORKER)
    held_s = time.monotonic() - cut_at
    tell("restored")
    summary = json.loads(lines.expect("summary", REJOIN_TIMEOUT_S + 60).removeprefix("summary"))
    assert client.wait(timeout=STEP_TIMEOUT_S) == 0
    return {**summary, "cut_s": held_s}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cut", ["past-ttl", "past-socket-timeout"])
def test_a_worker_host_cut_off_loses_nothing_and_rejoins_fenced(hosts: Hosts, tmp_path: Path, cut: str) -> None:
    start_cluster(hosts, tmp_path)
    try:
        summary = run_client(hosts, tmp_path, CUTS_S[cut])
    except BaseException:
        print(log_tails(tmp_path))  # shown by pytest when the test fails
        raise
    print(json.dumps(summary, indent=1))
    rejoined = f"{CUT_WORKER}~1"
    # 400 requests in flight when the link went down, for longer than the heartbeat TTL.
    assert summary["outstanding_at_cut"] == REQUESTS
    assert summary["held_at_cut"][CUT_WORKER] > 0 and summary["held_at_cut"][OTHER_WORKER] > 0
    assert summary["cut_s"] > HEARTBEAT_TTL_S
    # 400 results, each once, each whole (echo: the completion is the prompt's first TOKENS tokens).
    assert summary["results"] == REQUESTS and summary["positions_answered_twice"] == 0
    assert summary["distinct_request_ids"] == REQUESTS and summary["whole"] == REQUESTS
    assert summary["duplicates"] == 0 and summary["retries"] == 0  # nothing (not even an abort) came twice
    # The cut worker's requests moved; nothing the old incarnation published reached the caller.
    assert summary["moved"] > 0
    assert CUT_WORKER not in summary["moved_served_by"], summary["moved_served_by"]
    assert summary["served_by"].get(CUT_WORKER, 0) == 0  # it was cut before it finished anything
    assert summary["fenced_results"] > 0  # what it finished while cut off, it dropped
    # After the link came back it rejoined as a new incarnation and serves again.
    assert summary["rejoined"] == {"worker_id": rejoined, "incarnation": 1, "state": "serving"}
    assert summary["rejoin_served_by"].get(rejoined, 0) > 0, summary["rejoin_served_by"]
    assert summary["rejoin_whole"] == REJOIN_REQUESTS
    assert summary["served_after"] > summary["served_before"]
    # Nothing left behind in Redis: no request pending or queued, no dead letter.
    assert summary["left_in_redis"] == {"pending": 0, "queued": 0, "dead_letters": 0}


# --- the client's side: runs inside the client namespace -------------------------------------------------------------


class Orders:
    """Lines from the test on stdin, read by a daemon thread (it must not hold up the exit)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._pump, args=(loop,), daemon=True).start()

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(self._queue.put_nowait, line.strip())

    async def hear(self, word: str, timeout_s: float) -> None:
        line = await asyncio.wait_for(self._queue.get(), timeout_s)
        assert line == word, f"expected {word!r} from the test, got {line!r}"


def say(line: str) -> None:
    print(line, flush=True)


def prompts(count: int, salt: int) -> list[list[int]]:
    """Distinct prompts longer than TOKENS: each one's echo completion is its first TOKENS tokens."""
    return [[(salt + 7 * i + j) % 250 + 1 for j in range(TOKENS + 8)] for i in range(count)]


async def client_main(cut_id: str, other_id: str) -> dict[str, Any]:
    from rollout_svc import RolloutClient
    from rollout_svc.config import Settings
    from rollout_svc.connections.urls import redis_async
    from tests.support import async_wait_until

    settings = Settings()
    keys = settings.keys
    orders = Orders()
    rds = redis_async(settings.redis_url)
    params = {"max_tokens": TOKENS}
    async with RolloutClient(settings) as client:

        async def live() -> dict[str, Any]:
            return {w.worker_id: w for w in await client.workers()}

        async def both_serving() -> bool:
            statuses = await live()
            return all(w in statuses and statuses[w].state == "serving" for w in (cut_id, other_id))

        await async_wait_until(both_serving, 60, "both workers serving", interval_s=0.1)
        # 1. 400 requests; once both workers hold some, the test cuts the link.
        batch = prompts(REQUESTS, salt=0)
        answers: dict[int, list[Any]] = {}

        async def collect() -> None:
            async for index, trajectory in client.as_completed(batch, params, timeout_s=120):
                answers.setdefault(index, []).append(trajectory)

        collecting = asyncio.create_task(collect())

        async def held() -> dict[str, int]:
            summary = await rds.xpending(keys.requests, "workers")
            return {c["name"].decode(): int(c["pending"]) for c in summary["consumers"]} if summary else {}

        async def both_hold() -> dict[str, int] | None:
            counts = await held()
            return counts if counts.get(cut_id, 0) >= 16 and counts.get(other_id, 0) >= 16 else None

        await async_wait_until(both_hold, 30, "both workers to hold requests", interval_s=0.01)
        say("cut-me")
        await orders.hear("cut", STEP_TIMEOUT_S)
        outstanding_at_cut = REQUESTS - len(answers)
        # 2. What the cut worker holds now can only be requeued, or fenced: it cannot reach Redis.
        held_at_cut = await held()
        moved = await held_request_ids(rds, keys.requests, cut_id)
        cut_heard_at = time.monotonic()

        async def reaped() -> bool:
            return not await rds.exists(keys.worker(cut_id)) and not await rds.sismember(keys.workers, cut_id)

        await async_wait_until(reaped, HEARTBEAT_TTL_S + STEP_TIMEOUT_S, f"{cut_id} reaped", interval_s=0.05)
        reaped_after_s = time.monotonic() - cut_heard_at
        say("reaped")
        await orders.hear("restored", max(CUTS_S.values()) + STEP_TIMEOUT_S)
        # 3. The link is back: the cut worker rejoins as a new incarnation; the 400 all come back.
        rejoined_id = f"{cut_id}~1"
        restored_at = time.monotonic()

        async def rejoined() -> bool:
            statuses = await live()
            return rejoined_id in statuses and statuses[rejoined_id].state == "serving"

        await async_wait_until(rejoined, REJOIN_TIMEOUT_S, f"{cut_id} to rejoin as {rejoined_id}", interval_s=0.05)
        rejoin_s = time.monotonic() - restored_at
        await asyncio.wait_for(collecting, 90)
        # 4. A second batch: the rejoined worker takes part of it.
        served_before = (await live())[rejoined_id].served
        second = prompts(REJOIN_REQUESTS, salt=3)
        trajectories = await client.generate(second, params, timeout_s=60)

        async def served_after() -> int:
            served = (await live())[rejoined_id].served
            return served if served > served_before else 0

        served_now = await async_wait_until(served_after, 5, "the rejoined worker's heartbeat to count", 0.05)
        final = (await live())[rejoined_id]
        firsts = [ts[0] for ts in answers.values()]
        summary = {
            "outstanding_at_cut": outstanding_at_cut,
            "held_at_cut": held_at_cut,
            "reaped_after_cut_s": round(reaped_after_s, 2),
            "rejoin_after_restore_s": round(rejoin_s, 2),
            "results": len(answers),
            "positions_answered_twice": sum(len(ts) > 1 for ts in answers.values()),
            "distinct_request_ids": len({t.request_id for t in firsts}),
            "whole": sum(whole(ts[0], batch[i]) for i, ts in answers.items()),
            "served_by": Counter(t.worker_id for t in firsts),
            "moved": len(moved),
            "moved_served_by": Counter(t.worker_id for t in firsts if t.request_id in moved),
            "duplicates": client.stats.duplicates,
            "retries": client.stats.retries,
            "fenced_results": final.fenced_results,
            "rejoined": {"worker_id": final.worker_id, "incarnation": final.incarnation, "state": final.state},
            "rejoin_served_by": Counter(t.worker_id for t in trajectories),
            "rejoin_whole": sum(whole(t, p) for t, p in zip(trajectories, second, strict=True)),
            "served_before": served_before,
            "served_after": served_now,
            "left_in_redis": await left_in_redis(rds, keys.requests, keys.dead),
        }
    await rds.aclose()
    return summary


def whole(trajectory: Any, prompt: list[int]) -> bool:
    return trajectory.finish_reason in ("stop", "length") and trajectory.completion_token_ids == prompt[:TOKENS]


async def held_request_ids(rds: Any, stream: str, consumer: str) -> set[str]:
    """The request ids of the entries `consumer` has taken and not acknowledged."""
    from rollout_svc.keys import PAYLOAD_FIELD, WORKERS_GROUP
    from rollout_svc.protocol import decode

    ids = set()
    for item in await rds.xpending_range(stream, WORKERS_GROUP, "-", "+", 10_000, consumername=consumer):
        for _, fields in await rds.xrange(stream, item["message_id"], item["message_id"]):
            ids.add(decode(fields[PAYLOAD_FIELD]).request_id)
    return ids


async def left_in_redis(rds: Any, stream: str, dead: str) -> dict[str, int]:
    summary = await rds.xpending(stream, "workers")
    pending = int(summary["pending"]) if summary else 0
    return {"pending": pending, "queued": int(await rds.xlen(stream)) - pending, "dead_letters": await rds.xlen(dead)}


def main(argv: list[str]) -> int:
    cut_id, other_id = argv
    summary = asyncio.run(asyncio.wait_for(client_main(cut_id, other_id), 240))
    say("summary " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
