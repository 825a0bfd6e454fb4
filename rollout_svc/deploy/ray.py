"""Ray worker groups (the optional extra `ray`): rollout workers as Ray actors on one placement group.

`RayWorkerGroup` reserves one bundle per worker (`{"CPU": cpus_per_worker, "GPU": gpus_per_worker}`, PACK or
SPREAD; a worker whose engine spans GPUs, tensor x pipeline x data parallel, gets that many in its bundle, and Ray
sets its `CUDA_VISIBLE_DEVICES`) and starts a `WorkerHost` actor on each. The actor runs `python -m workers` as its
child process with the group's settings as `ROLLOUT_*` env vars and a stable worker id (`{name}-{i}`, so a
replacement is the same slot), watches it and starts it again if it exits. An actor that dies is restarted by Ray on
its bundle (`max_restarts=-1`); its child gets SIGTERM when the actor dies (PR_SET_PDEATHSIG), so it drains,
requeues and deregisters, and the replacement waits for it before starting a worker under the same id. Workers need
no ports: Redis is all that joins them.

Ray is imported only inside the functions that use it: `import rollout_svc` never imports it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

import redis

from rollout_svc.config import EngineSettings, Settings, settings_env
from rollout_svc.connections import urls as connect
from rollout_svc.connections.urls import redis_sync
from rollout_svc.deploy.processes import cpu_sets, die_with_parent, signal_group

log = logging.getLogger("rollout_svc.deploy.ray")
RAY_MISSING = "Ray worker groups need Ray: pip install 'rollout-svc[ray]'"
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def import_ray() -> Any:
    """The `ray` module, or ImportError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(RAY_MISSING) from exc
    return ray


def worker_bundles(
    num_workers: int, gpus_per_worker: float = 0, cpus_per_worker: float = 1, gpu_resource: str = "GPU"
) -> list[dict[str, float]]:
    """One placement-group bundle per worker, zero entries left out; its GPUs counted under `gpu_resource` (Ray's
    `GPU`, or a custom resource standing in for GPUs). ValueError if a bundle would be empty (Ray refuses all-zero
    bundles) or a count is negative."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, not {num_workers}")
    if gpus_per_worker < 0 or cpus_per_worker < 0:
        raise ValueError(f"resources per worker cannot be negative: {cpus_per_worker} CPUs, {gpus_per_worker} GPUs")
    amounts = (("CPU", cpus_per_worker), (gpu_resource, gpus_per_worker))
    bundle = {name: float(amount) for name, amount in amounts if amount}
    if not bundle:
        raise ValueError("each worker needs cpus_per_worker > 0 or gpus_per_worker > 0: Ray refuses all-zero bundles")
    return [dict(bundle) for _ in range(num_workers)]


def placement_strategy(placement: str) -> str:
    """Ray's placement-group strategy for `pack`, `spread` (or `strict_pack`, `strict_spread`)."""
    try:
        return PLACEMENTS[placement.lower()]
    except KeyError:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {placement!r}") from None


def node_shares(bundle_nodes: list[str], ranks: int = 1) -> list[tuple[int, int, int]]:
    """For each bundle, (its index among the bundles on its node, how many are on that node, the engine's ranks):
    its share of the node's CPUs when engines run on CPUs (`cpu_sets`)."""
    counts, seen = Counter(bundle_nodes), Counter[str]()
    shares = []
    for node in bundle_nodes:
        shares.append((seen[node], counts[node], ranks))
        seen[node] += 1
    return shares


def is_loopback(redis_url: str) -> bool:
    """Whether a Redis URL points at this machine (only this node's workers could reach it)."""
    return connect.is_loopback(urlparse(redis_url).hostname or "127.0.0.1")


@dataclass(frozen=True)
class WorkerInfo:
    """One slot as its actor sees it: the actor's process id, its worker child's (None while restarting), the
    resources Ray assigned it (`ray.get_runtime_context().get_assigned_resources()`, from its bundle) and the
    `CUDA_VISIBLE_DEVICES` Ray set for its GPUs ("" without)."""

    worker_id: str
    actor_pid: int
    worker_pid: int | None
    alive: bool
    restarts: int
    node_ip: str
    resources: dict[str, float] = field(default_factory=dict)
    cuda_visible_devices: str = ""


class WorkerHost:
    """The body of one Ray actor: one `python -m workers` child, started again `RESTART_DELAY_S` after it exits.

    `args` follow the interpreter (`-m workers ...`): the child runs under this node's Python, the actor's own.
    The child runs in its own process group (stopping it stops vLLM's engine-core process too) and gets SIGTERM
    if this actor's watcher thread dies (the actor is killed): it then drains and deregisters on its own.
    `cpu_share` (index, count, ranks): bind the engine to its share of this node's CPUs, unless the node's environment
    sets `VLLM_CPU_OMP_THREADS_BIND`. `pid_file` (a name in this node's temp folder) records the child, so that the
    actor Ray starts in place of a dead one waits for the old child to finish draining (at most
    `PREVIOUS_GRACE_S`, then SIGKILL): two processes never serve under one worker id.
    """

    RESTART_DELAY_S = 2.0
    PREVIOUS_GRACE_S = 60.0

    def __init__(
        self,
        worker_id: str,
        args: list[str],
        env: dict[str, str],
        log_dir: str | None = None,
        cpu_share: tuple[int, int, int] | None = None,
        pid_file: str | None = None,
    ) -> None:
        self.worker_id, self.args, self.env = worker_id, args, {**os.environ, **env}
        self.pid_path = Path(tempfile.gettempdir()) / "rollout-svc" / pid_file if pid_file else None
        if cpu_share is not None and CPU_BIND not in os.environ:
            self.env[CPU_BIND] = cpu_sets(cpu_share[1], cpu_share[2])[cpu_share[0]]
        self.log_path = Path(log_dir) / f"{worker_id}.log" if log_dir else None
        self.restarts = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # stop() never meets a child half-started
        self._stopping = threading.Event()
        # The watcher starts every child: PR_SET_PDEATHSIG follows the thread that forked it, and this one lives
        # until stop() (or the actor's death).
        self._watcher = threading.Thread(target=self._watch, name=f"watch-{worker_id}", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        self._wait_for_previous()
        delay = 0.0
        while not self._stopping.wait(delay):
            with self._lock:
                if self._stopping.is_set():
                    return
                process = self._spawn()
                if self.pid_path is not None:  # before the child is visible: whoever sees it finds its pid file
                    temp = self.pid_path.with_suffix(".tmp")
                    temp.write_text(str(process.pid))
                    temp.replace(self.pid_path)  # atomic: a reader never finds it empty or half-written
                self._process = process
            while process.poll() is None:
                if self._stopping.wait(0.5):
                    return
            log.warning("worker %s exited with %s; starting it again", self.worker_id, process.returncode)
            signal_group(process, signal.SIGKILL)  # what it left behind (an engine-core process)
            self.restarts += 1
            delay = self.RESTART_DELAY_S

    def _wait_for_previous(self) -> None:
        """If this slot's last worker still runs here (its actor died; it drains), wait for it, then kill what is
        left of its process group (vLLM's engine-core process)."""
        if self.pid_path is None:
            return
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            previous = int(self.pid_path.read_text())
        except (FileNotFoundError, ValueError):
            return
        if not _serves(previous, self.worker_id):
            return
        log.warning("worker %s: its last process (%d) is still draining; waiting for it", self.worker_id, previous)
        deadline = time.monotonic() + self.PREVIOUS_GRACE_S
        while _serves(previous, self.worker_id) and time.monotonic() < deadline:
            if self._stopping.wait(0.2):
                break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(previous, signal.SIGKILL)

    def _spawn(self) -> subprocess.Popen[bytes]:
        out: IO[bytes] | None = None  # no log folder: the child writes to the actor's log (Ray streams it)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        try:
            args = die_with_parent([sys.executable, *self.args])
            return subprocess.Popen(args, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if out is not None:
                out.close()  # the child has its own descriptor now

    def info(self) -> WorkerInfo:
        process = self._process
        alive = process is not None and process.poll() is None
        ray = import_ray()
        node_ip, resources = ray.util.get_node_ip_address(), {}
        if ray.is_initialized():  # in an actor; outside one (unit tests) asking would start a Ray instance
            with contextlib.suppress(AssertionError):  # Ray asserts it runs in a worker process
                resources = ray.get_runtime_context().get_assigned_resources()
        pid = process.pid if process else None
        cuda = self.env.get("CUDA_VISIBLE_DEVICES", "")
        return WorkerInfo(self.worker_id, os.getpid(), pid, alive, self.restarts, node_ip, dict(resources), cuda)

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def alive(self) -> bool:
        """Whether the worker process runs (it may still be starting its engine)."""
        return self.info().alive

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the worker (it drains and requeues), wait up to `timeout_s`, then SIGKILL its process group.
        Returns its exit status (None if none was running)."""
        self._stopping.set()
        with self._lock:
            process = self._process
        if process is None:
            return None
        signal_group(process, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout_s)
        signal_group(process, signal.SIGKILL)
        if self.pid_path is not None:
            self.pid_path.unlink(missing_ok=True)
        return process.wait()


def _serves(pid: int, worker_id: str) -> bool:
    """Whether process `pid` runs (not a zombie) as worker `worker_id` (Linux; elsewhere False)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, IndexError):
        return False
    return state != "Z" and any(a == b"--worker-id" and b == worker_id.encode() for a, b in itertools.pairwise(args))


class RayWorkerGroup:
    """`num_workers` rollout workers as Ray actors, one per bundle of one placement group.

    `settings` (Redis URL, key prefix, ...) reach the workers as `ROLLOUT_*` env vars: the Redis URL must be
    reachable from every Ray node. `engine` is each worker's engine; worker i gets seed `engine.seed + i` and the id
    `{name}-{i}`. vLLM workers without GPUs split their node's CPUs (`VLLM_CPU_OMP_THREADS_BIND`) unless the node
    sets it. Every Ray node needs this package installed (the actors import `rollout_svc.deploy.ray` and run
    `python -m workers`). `ray_address`: if Ray is not initialized, `start` calls `ray.init(address=ray_address)`
    (None: `RAY_ADDRESS` or a new local instance; `auto`, `host:port`, `ray://host:port`, `local`) and `shutdown`
    calls `ray.shutdown()`. `log_dir`: a folder on each node for the workers' logs (default: the actors' logs,
    which Ray streams to the driver).

    `gpus_per_worker`: None (the default) gives each bundle the engine's GPUs (`EngineSettings.gpus`: tensor x
    pipeline x data parallel size) where the cluster has `gpu_resource`, and none where it has none (engines on
    CPUs); a number is taken as given, and `start` refuses fewer than the engine spans (ValueError). `gpu_resource`:
    Ray's `GPU` (Ray then sets each worker's `CUDA_VISIBLE_DEVICES`), or a custom resource that stands in for GPUs
    (a node started with `resources={"fake_gpu": 4}`: the bundle arithmetic and replacement, on CPUs).
    """

    MAX_START_FAILURES = 3  # `wait_ready` gives up on a worker that exits this often before it is ready

    def __init__(
        self,
        num_workers: int,
        gpus_per_worker: float | None = None,
        cpus_per_worker: float = 1,
        placement: str = "pack",
        settings: Settings | None = None,
        engine: EngineSettings | None = None,
        name: str = "ray-worker",
        ray_address: str | None = None,
        log_dir: str | Path | None = None,
        placement_timeout_s: float = 60.0,
        gpu_resource: str = "GPU",
    ) -> None:
        # checked now, before any Ray call (a default GPU count, known at `start`, counts as none here: bundles of
        # GPUs alone need gpus_per_worker); `start` computes them again
        self.bundles = worker_bundles(num_workers, gpus_per_worker or 0, cpus_per_worker)
        self.gpu_resource = gpu_resource
        self.strategy = placement_strategy(placement)
        self.num_workers, self.gpus_per_worker, self.cpus_per_worker = num_workers, gpus_per_worker, cpus_per_worker
        self.settings, self.engine = settings or Settings(), engine or EngineSettings()
        self.name, self.ray_address, self.placement_timeout_s = name, ray_address, placement_timeout_s
        self.log_dir = str(Path(log_dir).absolute()) if log_dir is not None else None
        self.worker_ids = [f"{name}-{i}" for i in range(num_workers)]
        self.actors: list[Any] = []
        self.placement_group: Any = None
        self.resolved_gpus = 0.0  # each worker's GPUs, once `start` resolved them
        self._owns_ray = False

    def __enter__(self) -> RayWorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> None:
        """Reserve the bundles and start one actor per worker. Returns once the actors exist (see `wait_ready`).
        Raises `RuntimeError` if Ray cannot place the bundles within `placement_timeout_s`."""
        ray = import_ray()
        if not ray.is_initialized():
            with _keeping_sigterm_handler():
                ray.init(address=self.ray_address)
            self._owns_ray = True
        self._warn_if_redis_unreachable(ray)
        try:
            self.bundles = self._bundles(ray)
            self.placement_group = self._reserve(ray)
            host = ray.remote(WorkerHost)
            self.actors = [self._actor(host, i, share) for i, share in enumerate(self._cpu_shares())]
        except BaseException:
            self.shutdown()  # a failed start leaves nothing behind
            raise

    def _bundles(self, ray: Any) -> list[dict[str, float]]:
        """The bundles to reserve: `gpus_per_worker`, or by default the engine's GPUs where the cluster has them."""
        gpus = self.gpus_per_worker
        if gpus is None:
            gpus = self.engine.gpus if ray.cluster_resources().get(self.gpu_resource, 0) > 0 else 0
        elif 0 < gpus < self.engine.gpus:
            raise ValueError(
                f"a worker's engine spans {self.engine.gpus} GPUs (tensor x pipeline x data parallel size "
                f"{self.engine.tensor_parallel_size} x {self.engine.pipeline_parallel_size} x "
                f"{self.engine.data_parallel_size}) but gpus_per_worker is {gpus:g}: give it at least that many"
            )
        self.resolved_gpus = float(gpus)
        return worker_bundles(self.num_workers, gpus, self.cpus_per_worker, self.gpu_resource)

    def _reserve(self, ray: Any) -> Any:
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group(self.bundles, strategy=self.strategy, name=f"{self.name}-group")
        if not group.wait(timeout_seconds=self.placement_timeout_s):
            remove_placement_group(group)
            raise RuntimeError(
                f"Ray could not place {self.num_workers} bundles of {self.bundles[0]} ({self.strategy}) in "
                f"{self.placement_timeout_s:g} s: the cluster has {_resources(ray.cluster_resources())} "
                f"({_resources(ray.available_resources())} free)"
            )
        return group

    def _cpu_shares(self) -> Sequence[tuple[int, int, int] | None]:
        """vLLM on CPUs: each engine's share of its node's CPUs (a set per rank); otherwise none."""
        if self.engine.engine != "vllm" or self.resolved_gpus:
            return [None] * self.num_workers
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(self.placement_group)["bundles_to_node_id"]
        return node_shares([nodes[i] for i in range(self.num_workers)], self.engine.gpus)

    def _actor(self, host: Any, i: int, cpu_share: tuple[int, int, int] | None) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        engine = self.engine.model_copy(update={"seed": self.engine.seed + i})
        args = ["-m", "workers", "--worker-id", self.worker_ids[i], "--engine", engine.engine]
        args += engine.to_args()
        if self.gpu_resource == "GPU":  # Ray sets CUDA_VISIBLE_DEVICES for these
            gpus: dict[str, Any] = {"num_gpus": self.resolved_gpus}
        else:
            gpus = {"resources": {self.gpu_resource: self.resolved_gpus}} if self.resolved_gpus else {}
        options = host.options(
            num_cpus=self.cpus_per_worker,
            **gpus,
            max_restarts=-1,  # Ray starts a dead actor again on its bundle, with these arguments
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i),
        )
        pid_file = f"{self.settings.key_prefix}.{self.worker_ids[i]}.pid"
        return options.remote(self.worker_ids[i], args, settings_env(self.settings), self.log_dir, cpu_share, pid_file)

    def _warn_if_redis_unreachable(self, ray: Any) -> None:
        if not is_loopback(self.settings.redis_url):
            return
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        if len(nodes) > 1 or (self.ray_address or "").startswith("ray://"):
            log.warning(
                "the workers get the Redis URL %s, a loopback address: Ray actors on other nodes cannot reach it; "
                "give a Redis URL with an address that every Ray node reaches",
                self.settings.redis_url,
            )

    def info(self, timeout_s: float = 10.0) -> list[WorkerInfo | None]:
        """Each slot's `WorkerInfo`, or None where its actor does not answer (dead, restarting) in `timeout_s`."""
        ray = import_ray()
        refs = [actor.info.remote() for actor in self.actors]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        return [_get_or_none(ray, ref) for ref in refs]

    def pids(self) -> list[int | None]:
        """Each slot's actor process id (None where it does not answer)."""
        return [i.actor_pid if i else None for i in self.info()]

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until every worker heartbeats in Redis. Raises `RuntimeError` if one keeps exiting during start-up
        or time runs out."""
        client = redis_sync(self.settings.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while (live := self._live(client)) < self.num_workers:
                self._raise_if_failing()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {live} of {self.num_workers} Ray workers up after {timeout_s:g} s")
                time.sleep(1.0)
        finally:
            client.close()

    def _live(self, client: redis.Redis) -> int:
        return sum(bool(client.exists(self.settings.keys.worker(w))) for w in self.worker_ids)

    def _raise_if_failing(self) -> None:
        failing = [i for i in self.info(timeout_s=5.0) if i is not None and i.restarts >= self.MAX_START_FAILURES]
        if failing:
            where = f"in {self.log_dir} on its node" if self.log_dir else "in the Ray actor's log (streamed above)"
            raise RuntimeError(f"{failing[0].worker_id} keeps exiting during start-up; see its log {where}")

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every worker (SIGTERM, drain, then SIGKILL of its process group), kill the actors, release the
        placement group; `ray.shutdown()` if `start` initialized Ray."""
        if not self.actors and self.placement_group is None and not self._owns_ray:
            return
        ray = import_ray()
        refs = [actor.stop.remote(timeout_s) for actor in self.actors]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s + 10)
        for ref in refs:
            _get_or_none(ray, ref)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        self.actors, self.placement_group = [], None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


@contextlib.contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """`ray.init` makes SIGTERM exit the process at once (status 15): keep the handler the caller had."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread() and handler is not None:
            signal.signal(signal.SIGTERM, handler)


def _get_or_none(ray: Any, ref: Any) -> Any:
    """The result of a finished call, or None if it failed or has not finished."""
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return None
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None


def _resources(resources: dict[str, float]) -> str:
    names = ("CPU", "GPU")
    return ", ".join(f"{resources.get(name, 0):g} {name}" for name in names)
