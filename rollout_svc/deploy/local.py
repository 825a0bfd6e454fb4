"""A local cluster on one machine: a Redis (private if none answers) or a local Redis Cluster, N worker processes,
optionally the API."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

import redis

from rollout_svc.config import EngineSettings, Settings, settings_env
from rollout_svc.connections.acl import Credentials, create_users
from rollout_svc.connections.topology import probe_cluster, redis_router_sync
from rollout_svc.connections.urls import is_loopback, redacted, redis_sync
from rollout_svc.deploy.processes import cpu_sets, die_with_parent, gpu_sets, signal_group, visible_gpus
from rollout_svc.deploy.redis_cluster import RedisClusterServers, worker_shard
from rollout_svc.keys import Keys

log = logging.getLogger("rollout_svc.deploy.local")
ACL_NEEDS_PRIVATE_REDIS = (
    "--acl creates the Redis users only in the private Redis that `up` starts, and a Redis already answers at "
    "--redis-url: create the users there yourself (`rollout-svc acl rules` prints the ACL SETUSER lines; docs/acl.md, "
    "'Redis ACL users') and give each process its user's URL, or point --redis-url at a free port"
)
ACL_NOT_ON_CLUSTER = "--acl creates its users in one Redis, not on every node of a Redis Cluster: leave out one of them"


MODEL_GROUP_FORM = "NAME=N or NAME=N:MODEL (e.g. policy=2, or judge=1:/models/judge)"


@dataclass(frozen=True)
class ModelGroup:
    """`up`'s workers for one served model: `workers` processes serving named model `name` (`Settings.model_name`;
    "": the fleet's default model), on `model` (a folder or hub id; None: the engine settings' model)."""

    name: str
    workers: int
    model: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelGroup:
        """`NAME=N` or `NAME=N:MODEL` (`up --model-group`). Raises `ValueError` saying the form it expects."""
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._\-]{0,127})=([0-9]+)(?::(.+))?", text.strip())
        if match is None or int(match[2]) < 1:
            raise ValueError(f"a model group is {MODEL_GROUP_FORM}, with N >= 1; got {text!r}")
        return cls(match[1], int(match[2]), match[3])


def check_groups(groups: Sequence[ModelGroup]) -> None:
    """Raise `ValueError` if two groups name one model: each needs a name of its own."""
    names = [g.name for g in groups]
    if len(set(names)) < len(names):
        listed = ", ".join(names)
        raise ValueError(f"the list of model groups names a model twice ({listed}): each group needs a name of its own")


def redis_answers(url: str, timeout_s: float = 0.5) -> bool:
    client = redis_sync(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def _last_words(output: IO[bytes]) -> str:
    """The last three lines a process wrote to `output` (a file), joined; "" if none."""
    output.seek(0)
    lines = output.read().decode(errors="replace").strip().splitlines()
    return " / ".join(line.strip() for line in lines[-3:])


class PrivateRedis:
    """`up`'s own Redis, listening where `url` points: `redis-server` from PATH, else fakeredis (with a warning).

    It keeps an append-only file (fsync every second) in `data_dir`, so stopping and starting it again (a SIGTERM
    flushes the file) keeps every queued request, pending entry and the control state. `bind`: the interfaces it
    listens on (default: the URL's host); a password in the URL becomes its `requirepass`. Without `data_dir` it keeps
    nothing (the fakeredis fallback never does).
    """

    def __init__(self, url: str, data_dir: Path | None = None, bind: str | None = None) -> None:
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 6379
        self.url, self.data_dir, self.bind = url, data_dir, bind or self.host
        self.password = parsed.password
        self.process: subprocess.Popen[bytes] | None = None
        self._fake: Any = None

    def args(self, binary: str) -> list[str]:
        """The `redis-server` command line."""
        args = [binary, "--port", str(self.port), "--bind", *self.bind.split(","), "--save", ""]
        # Each worker holds a few connections (its take loop's, its publisher's, its control subscription's, its
        # pool's): 1,024 simulated GPUs passed Redis's default of 10,000 clients. As many as this process may open.
        args += ["--maxclients", str(max(10_000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64))]
        if self.data_dir is not None:
            args += ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.data_dir)]
        else:
            args += ["--appendonly", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if not all(is_loopback(host) for host in self.bind.split(",")):
            # Reachable from other hosts: `up` refuses that without users or a password.
            args += ["--protected-mode", "no"]
        return args

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it and return once it answers. A port held by another socket is tried again until `timeout_s` (an
        outgoing connection may hold it for a moment). `RuntimeError` naming Redis's own last words if it exits or
        does not answer in `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        binary = shutil.which("redis-server")
        if not binary:
            self._start_fake()
            if not self._answers_by(deadline):
                raise RuntimeError(f"could not start a fakeredis at {redacted(self.url)} in {timeout_s:.0f} s")
            return
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        said = ""  # what the last Redis that said anything said: one killed at the deadline may not have yet
        while True:
            with tempfile.TemporaryFile() as output:  # Redis logs to it (unlinked: gone once both ends close)
                self.process = subprocess.Popen(die_with_parent(self.args(binary)), stdout=output, stderr=output)
                if self._answers_by(deadline):
                    return
                self.process.kill()  # out of time before it answered or exited; a no-op if it exited
                self.process.wait()
                said = _last_words(output) or said
            if "already in use" in said and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise RuntimeError(
                f"could not start a Redis at {redacted(self.url)} in {timeout_s:.0f} s: {said or 'it said nothing'}"
            )

    def _answers_by(self, deadline: float) -> bool:
        """Whether it answers before `deadline` (False at once if its process exited)."""
        while not redis_answers(self.url):
            if time.monotonic() > deadline or (self.process is not None and self.process.poll() is not None):
                return False
            time.sleep(0.05)
        return True

    def _start_fake(self) -> None:
        try:
            from fakeredis import TcpFakeServer
        except ImportError as exc:
            raise RuntimeError(
                "no redis-server on PATH and fakeredis is not installed: install Redis >= 6.2 "
                "(apt install redis-server) or `pip install 'fakeredis[lua]'` to try things out"
            ) from exc
        log.warning("no redis-server on PATH: using fakeredis, which is for trying things out, not for real runs")
        self._fake = TcpFakeServer((self.host, self.port), server_type="redis", server_version=(7, 0))
        self._fake.daemon_threads = True
        threading.Thread(target=self._fake.serve_forever, name="fakeredis", daemon=True).start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._fake is not None:
            self._fake.shutdown()
            self._fake.server_close()


@dataclass
class _Child:
    """One supervised child process and how to start it again."""

    name: str
    args: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0


class LocalCluster:
    """Redis + N workers (+ the API) as child processes of this one; `stop()` leaves none behind.

    Each child runs in its own process group, so stopping it also stops what it started (vLLM's
    engine-core process). A child that exits (a crash, an engine that died, a `kill -9`) is started
    again after `RESTART_DELAY_S`, as a process manager would. Child logs go to
    `log_dir/<name>.log` when `log_dir` is given (appended across restarts).

    With `acl_file`, the private Redis gets the ACL users of `connections.acl` (its default user turned off): the
    workers connect as `worker`, the API and this process as `admin`, and the three URLs are written to `acl_file`
    (mode 0600; removed by `stop()`, the passwords dying with that Redis). A Redis that already answers is refused
    (`RuntimeError`): its users are its operator's to create (`rollout-svc acl rules`).

    With `groups`, the workers are groups of named models (`ModelGroup`: a policy and a reference, a judge), each
    worker started with its group's `ROLLOUT_MODEL_NAME` (and model), so each group has queues, pauses and syncs of
    its own in the one Redis; `workers` is then their sum.

    With `redis_cluster` N >= 1, a local Redis Cluster of N primaries (`RedisClusterServers`, on the URL's port and
    the next N-1) takes the private Redis's place, and worker i joins shard `g{i % N}` (`ROLLOUT_SHARD`). A
    cluster that already answers at the URL is used as it is (a Redis that is no cluster is refused). Its nodes
    keep their folders under `settings.redis_data_dir` (one per port) if set; otherwise each start wipes them
    (under `<cache dir>/redis/cluster-<port>`) and creates a new cluster. Not with `acl_file`.
    """

    RESTART_DELAY_S = 2.0
    MAX_START_FAILURES = 3  # `wait_ready` gives up on a child that exits this often before it is ready

    def __init__(
        self,
        settings: Settings,
        workers: int,
        engine: EngineSettings | None = None,
        api_port: int | None = None,
        api_host: str = "127.0.0.1",
        log_dir: Path | None = None,
        acl_file: Path | None = None,
        redis_bind: str | None = None,
        redis_cluster: int = 0,
        groups: Sequence[ModelGroup] = (),
    ) -> None:
        self.groups = list(groups) or [ModelGroup(settings.model_name, workers)]
        self._grouped = bool(groups)  # children named after their groups (`policy-0`), else `worker-{i}`
        check_groups(self.groups)
        self.settings, self.worker_count = settings, sum(g.workers for g in self.groups)
        self.redis_cluster = redis_cluster
        self.redis_bind = redis_bind
        self.engine = engine or settings.engine
        self.api_port, self.api_host = api_port, api_host
        self.log_dir, self.acl_file = log_dir, acl_file
        self.credentials: Credentials | None = None  # with `acl_file`, once `start` created the users
        self.redis: PrivateRedis | None = None
        self.redis_servers: RedisClusterServers | None = None  # with `redis_cluster`, the one `start` started
        self.children: list[_Child] = []
        self._devices: list[str] = []  # each worker's CUDA_VISIBLE_DEVICES (vLLM on GPUs), set by `start`
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    def start(self) -> None:
        """Start Redis if none answers, then the workers and the API. Returns at once (see `wait_ready`).

        Raises `RuntimeError` if no Redis can be started, or, with `acl_file`, if a Redis already answers or there
        is no `redis-server` (fakeredis enforces no ACLs); `ValueError`, before anything starts, if vLLM workers on
        this host's GPUs need more than it has."""
        gpus = visible_gpus() if self.engine.engine == "vllm" and self.worker_count else []
        self._devices = gpu_sets(self.worker_count, self.engine.gpus, gpus) if gpus else []
        if self.redis_cluster:
            self._start_redis_cluster()
        elif not redis_answers(self.settings.redis_url):
            if urlparse(self.settings.redis_url).scheme != "redis":
                raise RuntimeError(
                    f"no Redis answers at {redacted(self.settings.redis_url)}; `up` starts a private Redis only for a "
                    "redis:// URL: check the URL (TLS, Sentinel) and that the server is up"
                )
            if self.acl_file is not None and not shutil.which("redis-server"):
                raise RuntimeError("--acl needs redis-server on PATH: fakeredis does not enforce Redis ACLs")
            data_dir = self.settings.redis_data_dir or (
                self.settings.cache_dir / "redis" / str(urlparse(self.settings.redis_url).port or 6379)
            )
            self.redis = PrivateRedis(self.settings.redis_url, data_dir, self.redis_bind)
            self.redis.start()
            log.info(
                "started a private Redis at %s (append-only file in %s)", redacted(self.settings.redis_url), data_dir
            )
        elif self.acl_file is not None:
            raise RuntimeError(ACL_NEEDS_PRIVATE_REDIS)
        if self.acl_file is not None:
            self._create_users(self.acl_file)
        env = {**os.environ, **settings_env(self.settings)}
        self.children.extend(self._worker_children(env))
        if self.api_port is not None:
            args = [sys.executable, "-m", "rollout_svc", "serve", "--host", self.api_host, "--port", str(self.api_port)]
            self.children.append(_Child("api", args, env))
        for child in self.children:
            self._spawn(child)
        self._supervisor = threading.Thread(target=self._supervise, name="cluster-supervisor", daemon=True)
        self._supervisor.start()

    def _start_redis_cluster(self) -> None:
        """Use the Redis Cluster that answers at the URL, or start one there; RuntimeError if a Redis that is no
        cluster answers, or with `acl_file`."""
        url = self.settings.redis_url
        if self.acl_file is not None:
            raise RuntimeError(ACL_NOT_ON_CLUSTER)
        if redis_answers(url):
            if not probe_cluster(url):
                raise RuntimeError(
                    f"a Redis that is not a Redis Cluster answers at {redacted(url)}: point --redis-url at a free "
                    "port (a cluster is started there) or at a node of a running Redis Cluster"
                )
            log.info("using the Redis Cluster that answers at %s", redacted(url))
            return
        parsed = urlparse(url)
        if parsed.scheme != "redis":
            raise RuntimeError(f"`up` starts a Redis Cluster only for a redis:// URL, not {redacted(url)}")
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
        fresh = self.settings.redis_data_dir is None  # nothing to keep: a new cluster each time
        data_dir = self.settings.redis_data_dir or (self.settings.cache_dir / "redis" / f"cluster-{port}")
        servers = RedisClusterServers(
            host, port, self.redis_cluster, data_dir, parsed.password, bind=self.redis_bind, fresh=fresh
        )
        servers.start()
        self.redis_servers = servers
        log.info(
            "started a Redis Cluster of %d primaries on %s ports %s (folders in %s)",
            self.redis_cluster,
            host,
            ", ".join(map(str, servers.ports)),
            data_dir,
        )

    def worker_shards(self) -> list[str]:
        """The shard each worker joins: `g{i % redis_cluster}` on a Redis Cluster, else the settings' shard."""
        if not self.redis_cluster:
            return [self.settings.shard] * self.worker_count
        return [worker_shard(i, self.redis_cluster) for i in range(self.worker_count)]

    def worker_groups(self) -> list[tuple[ModelGroup, int]]:
        """Each worker's model group and its index in that group, in worker order."""
        return [(group, k) for group in self.groups for k in range(group.workers)]

    def _worker_children(self, env: dict[str, str]) -> list[_Child]:
        """One child per worker: `env` plus its GPUs (`CUDA_VISIBLE_DEVICES`: its own share of this host's, vLLM on
        GPUs; `ValueError` where there are too few) or its CPU share (vLLM on CPUs), its shard, its model group and,
        under --acl, its URL."""
        children = []
        binds, devices = cpu_sets(self.worker_count, self.engine.gpus), self._devices
        for i, (shard, (group, k)) in enumerate(zip(self.worker_shards(), self.worker_groups(), strict=True)):
            worker_env = {**env, "ROLLOUT_SHARD": shard, "ROLLOUT_MODEL_NAME": group.name}
            if devices:  # each worker its own GPUs, as `vllm serve` per GPU would have them
                worker_env["CUDA_VISIBLE_DEVICES"] = devices[i]
            if self.engine.engine == "vllm" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                worker_env["VLLM_CPU_OMP_THREADS_BIND"] = binds[i]
            # A seed of its own per worker: with one seed, unseeded samples of one group spread over two workers
            # would draw the same random numbers.
            engine = self.engine.model_copy(update={"seed": self.engine.seed + i})
            if group.model is not None:
                engine = engine.model_copy(update={"model": group.model})
            if self.credentials is not None:
                worker_env["ROLLOUT_REDIS_URL"] = self.credentials.worker
            args = [sys.executable, "-m", "workers", "--engine", engine.engine, *engine.to_args()]
            children.append(_Child(f"{group.name}-{k}" if self._grouped else f"worker-{i}", args, worker_env))
        return children

    def _create_users(self, acl_file: Path) -> None:
        """Create the ACL users in the private Redis, write their URLs, and go on as `admin` from here."""
        client = redis_sync(self.settings.redis_url)
        try:
            keys = Keys(self.settings.key_prefix)  # the deployment's: every model's keys (connections.acl.roles)
            self.credentials = create_users(client, keys, self.settings.redis_url)
        finally:
            client.close()
        self.credentials.write(acl_file)
        self.settings = self.settings.copy_with(redis_url=self.credentials.admin)

    def _spawn(self, child: _Child) -> None:
        out: IO[bytes] | None = None  # no log folder: the child writes to this terminal
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{child.name}.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            child.process = subprocess.Popen(
                die_with_parent(child.args), env=child.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            if out is not None:
                out.close()  # the child has its own descriptor now

    @contextlib.contextmanager
    def running(self, ready_timeout_s: float) -> Iterator[LocalCluster]:
        """Start, wait until every worker heartbeats, and stop on leaving (whatever happened inside)."""
        try:
            self.start()
            self.wait_ready(timeout_s=ready_timeout_s)
            yield self
        finally:
            self.stop()

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [c.process for c in self.children if c.process is not None]

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until every worker heartbeats. Raises `RuntimeError` if a child keeps exiting or time runs out."""
        placed = {(g.name, s) for s, (g, _) in zip(self.worker_shards(), self.worker_groups(), strict=True)}
        shards = [self.settings.copy_with(model_name=m).keys.of_shard(s) for m, s in sorted(placed)]
        client: Any = redis_router_sync(self.settings.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                live = 0
                for keys in shards:
                    members: Any = client.smembers(keys.workers)
                    live += sum(bool(client.exists(keys.worker(w.decode()))) for w in members)
                if live >= self.worker_count:
                    return
                failing = [c.name for c in self.children if c.restarts >= self.MAX_START_FAILURES]
                if failing:
                    where = f" in {self.log_dir}" if self.log_dir else " above"
                    raise RuntimeError(f"{failing[0]} keeps exiting during start-up; see its log{where}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {live} of {self.worker_count} workers up after {timeout_s:g} s")
                time.sleep(0.2)
        finally:
            client.close()

    def _supervise(self) -> None:
        while not self._stopping.wait(0.5):
            for child in self.children:
                if child.process is None or child.process.poll() is None:
                    continue
                log.warning("%s exited with %s; starting it again", child.name, child.process.returncode)
                signal_group(child.process, signal.SIGKILL)  # what it left behind (an engine-core process)
                if self._stopping.wait(self.RESTART_DELAY_S):
                    return
                child.restarts += 1
                self._spawn(child)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every child (workers drain and requeue), wait, then SIGKILL their process groups."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        for process in self.processes:
            signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %g s; killing it", process.args, timeout_s)
        for process in self.processes:
            signal_group(process, signal.SIGKILL)  # whatever a child left behind (engine-core processes)
            process.wait()
        if self.redis is not None:
            self.redis.stop()
        if self.redis_servers is not None:
            self.redis_servers.stop()
        if self.credentials is not None and self.acl_file is not None:
            self.acl_file.unlink(missing_ok=True)
