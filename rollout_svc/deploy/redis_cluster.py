"""A local Redis Cluster of N primaries (no replicas) for `up --redis-cluster N`, tests and benchmarks.

The primaries listen on `first_port` and the next N-1 ports (their cluster bus ports are +10000, Redis's default),
each with its own folder and an append-only file, `cluster-require-full-coverage no` (a dead primary's slots fail,
the others' are still served) and the URL's password as both `requirepass` and `masterauth`. `start()` starts them
(`redis-server` from PATH; a cluster has no fakeredis fallback), joins them into one cluster when they are blank
(`redis-cli --cluster create`; with fewer than 3 primaries, which redis-cli refuses, the same steps by hand) or
keeps the cluster their folders already hold, and waits until every node says `cluster_state:ok`.

Workers are spread over shards (`g0`, `g1`, ...: Redis Cluster hash tags) by `worker_shard`; with 3 primaries the
tags g0, g1 and g2 land on three different primaries (slots 9454, 13519 and 1196).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rollout_svc.connections.urls import is_loopback

log = logging.getLogger("rollout_svc.deploy.redis_cluster")
SLOTS = 16384
BUS_PORT_OFFSET = 10000  # Redis's default: a node's cluster bus listens on its port + 10000
NODE_TIMEOUT_MS = 5000


def cluster_ports(first_port: int, primaries: int) -> list[int]:
    """The ports of `primaries` primaries: `first_port` and the next ones. ValueError if one would not be a port."""
    if primaries < 1:
        raise ValueError(f"a Redis Cluster needs at least 1 primary, not {primaries}")
    if first_port < 1 or first_port + primaries - 1 + BUS_PORT_OFFSET > 65535:
        raise ValueError(
            f"ports {first_port}..{first_port + primaries - 1} (and their cluster bus ports, +{BUS_PORT_OFFSET}) "
            "must be below 65536"
        )
    return list(range(first_port, first_port + primaries))


def worker_shard(index: int, shards: int) -> str:
    """The shard worker `index` (0-based) joins when the workers are spread over `shards`: `g{index % shards}`."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    return f"g{index % shards}"


def cluster_info(client: redis.Redis) -> dict[str, str]:
    """`CLUSTER INFO` of the node `client` talks to, as text fields."""
    reply: Any = client.execute_command("CLUSTER", "INFO")
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def free_cluster_ports(primaries: int, host: str = "127.0.0.1") -> int:
    """A first port such that it, the next `primaries - 1` ports and their cluster bus ports (+10000) are all free
    on `host` (below the ephemeral range, so the bus ports stay under 65536). Raises `RuntimeError` if none is found
    in 200 tries."""
    for _ in range(200):
        first = random.randint(20000, 28000)
        ports = range(first, first + primaries)
        if all(_free(host, p) and _free(host, p + BUS_PORT_OFFSET) for p in ports):
            return first
    raise RuntimeError(f"no {primaries} consecutive free ports (and free cluster bus ports) found on {host}")


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class RedisClusterServers:
    """`primaries` local `redis-server` primaries in cluster mode on `first_port`, `first_port + 1`, ...

    `data_dir`: each node's folder is `data_dir/<port>` (nodes-<port>.conf and the append-only file there); a
    stopped cluster started again on the same folders comes back as the same cluster with its keys. Without
    `data_dir` the nodes get a temporary folder that `stop()` removes. `fresh`: first delete what an earlier run
    left in the nodes' folders (cluster config, append-only file), so a new cluster is created. `bind`: the
    interfaces the nodes listen on (default: `host`); `password` becomes `requirepass` and `masterauth`. Use it as
    a context manager (`with RedisClusterServers(...) as servers:` starts and stops it), or `start()`/`stop()`.
    """

    def __init__(
        self,
        host: str,
        first_port: int,
        primaries: int,
        data_dir: Path | None = None,
        password: str | None = None,
        bind: str | None = None,
        fresh: bool = False,
        node_timeout_ms: int = NODE_TIMEOUT_MS,
    ) -> None:
        self.ports = cluster_ports(first_port, primaries)
        self.host, self.password, self.bind = host, password, bind or host
        self.fresh, self.node_timeout_ms = fresh, node_timeout_ms
        self._owned_dir = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="rollout-redis-cluster-")) if data_dir is None else data_dir
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """A URL of the first primary (the one `up --redis-url` names)."""
        return self.url_of(self.ports[0])

    def url_of(self, port: int) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{port}/0"

    def node_dir(self, port: int) -> Path:
        return self.data_dir / str(port)

    def client(self, port: int, timeout_s: float = 2.0) -> redis.Redis:
        """A plain (non-cluster) client of one node that does not retry (a dead node answers at once)."""
        return redis.Redis(
            host=self.host,
            port=port,
            password=self.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    def args(self, port: int, binary: str = "redis-server") -> list[str]:
        """One node's `redis-server` command line."""
        args = [binary, "--port", str(port), "--bind", *self.bind.split(",")]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
        args += ["--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no"]
        args += ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.node_dir(port)), "--save", ""]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if not all(is_loopback(host) for host in self.bind.split(",")):
            args += ["--protected-mode", "no"]  # reachable from other hosts: `up` refuses that without a password
        return args

    def __enter__(self) -> RedisClusterServers:
        if not self.processes:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 30.0) -> RedisClusterServers:
        """Start the primaries, join them into one cluster if they are blank, and wait for `cluster_state:ok`
        everywhere; returns this, started. Raises `RuntimeError` (naming the ports) if that fails; what was started
        is stopped again."""
        from rollout_svc.deploy.processes import die_with_parent  # here: cluster.py imports this module

        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if not binary or not cli:
            raise RuntimeError("a Redis Cluster needs redis-server and redis-cli on PATH (apt install redis-server)")
        deadline = time.monotonic() + timeout_s
        try:
            for port in self.ports:
                self._prepare_dir(port)
                self.processes[port] = subprocess.Popen(
                    die_with_parent(self.args(port, binary)), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
                )
            for port in self.ports:
                self._wait_answers(port, deadline)
            if self._blank():
                self._create(cli, deadline)
            self.wait_ok(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        log.info("Redis Cluster of %d primaries up on %s:%s", len(self.ports), self.host, self._port_range())
        return self

    def _prepare_dir(self, port: int) -> None:
        folder = self.node_dir(port)
        folder.mkdir(parents=True, exist_ok=True)
        if self.fresh:  # only what Redis writes there: the folder may be the user's
            for name in (f"nodes-{port}.conf", "appendonly.aof", "dump.rdb"):
                (folder / name).unlink(missing_ok=True)
            shutil.rmtree(folder / "appendonlydir", ignore_errors=True)

    def _wait_answers(self, port: int, deadline: float) -> None:
        client = self.client(port, timeout_s=0.5)
        try:
            while True:
                process = self.processes[port]
                with contextlib.suppress(redis.RedisError, OSError):
                    info: Any = client.info("server")
                    if int(info.get("process_id", -1)) == process.pid:  # ours, not another server on that port
                        return
                if process.poll() is not None or time.monotonic() > deadline:
                    why = "no answer in time" if process.poll() is None else f"it exited with status {process.poll()}"
                    raise RuntimeError(
                        f"could not start a Redis Cluster node on port {port} ({why}); "
                        f"is port {port} free, and its cluster bus port {port + BUS_PORT_OFFSET}?"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    def infos(self) -> dict[int, dict[str, str]]:
        """Each node's `CLUSTER INFO` (an empty dict for a node that does not answer)."""
        infos: dict[int, dict[str, str]] = {}
        for port in self.ports:
            client = self.client(port, timeout_s=1.0)
            try:
                infos[port] = cluster_info(client)
            except (redis.RedisError, OSError):
                infos[port] = {}
            finally:
                client.close()
        return infos

    def _blank(self) -> bool:
        """True if every node is blank (to be joined), False if they already form this cluster (their folders held
        it); RuntimeError if they hold something else (parts of a cluster, another one)."""
        infos = self.infos()
        slots = [int(info.get("cluster_slots_assigned", -1)) for info in infos.values()]
        known = [int(info.get("cluster_known_nodes", -1)) for info in infos.values()]
        if all(s == 0 for s in slots) and all(k == 1 for k in known):
            return True
        if all(s == SLOTS for s in slots) and all(k == len(self.ports) for k in known):
            log.info("the Redis Cluster nodes on %s kept their cluster (%s)", self._port_range(), self.data_dir)
            return False
        raise RuntimeError(
            f"the Redis nodes on ports {self._port_range()} hold another cluster's configuration "
            f"(cluster_known_nodes {known}, cluster_slots_assigned {slots}): remove their folders in {self.data_dir}"
        )

    def _create(self, cli: str, deadline: float) -> None:
        ip = socket.gethostbyname(self.host)  # CLUSTER MEET takes an address, not a name
        if len(self.ports) < 3:  # redis-cli --cluster create refuses fewer than 3 primaries
            self._create_by_hand(ip)
            return
        nodes = [f"{ip}:{port}" for port in self.ports]
        command = [cli, "-h", ip, "-p", str(self.ports[0]), "--cluster", "create", *nodes]
        command += ["--cluster-replicas", "0", "--cluster-yes"]
        env = {**os.environ, "REDISCLI_AUTH": self.password} if self.password else None  # as -a, but not in `ps`
        try:
            out = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=max(5.0, deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"redis-cli --cluster create on ports {self._port_range()} timed out") from exc
        if out.returncode != 0:
            tail = (out.stdout + out.stderr).strip().splitlines()[-5:]
            raise RuntimeError(f"redis-cli --cluster create on ports {self._port_range()} failed: " + " / ".join(tail))

    def _create_by_hand(self, ip: str) -> None:
        """What redis-cli does: split the slots evenly, a config epoch per node, then MEET the others."""
        bounds = [i * SLOTS // len(self.ports) for i in range(len(self.ports) + 1)]
        clients = [self.client(port) for port in self.ports]
        try:
            for i, client in enumerate(clients):
                client.execute_command("CLUSTER", "ADDSLOTS", *range(bounds[i], bounds[i + 1]))
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for port in self.ports[1:]:
                clients[0].execute_command("CLUSTER", "MEET", ip, port)
        finally:
            for client in clients:
                client.close()

    def wait_ok(self, timeout_s: float) -> None:
        """Wait until every node says `cluster_state:ok` and knows all the primaries; RuntimeError after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            infos = self.infos()
            if all(
                info.get("cluster_state") == "ok" and info.get("cluster_known_nodes") == str(len(self.ports))
                for info in infos.values()
            ):
                return
            dead = [port for port, process in self.processes.items() if process.poll() is not None]
            if dead or time.monotonic() > deadline:
                states = ", ".join(f"{port}: {info.get('cluster_state', 'no answer')}" for port, info in infos.items())
                raise RuntimeError(
                    f"the Redis Cluster on ports {self._port_range()} did not reach cluster_state:ok in "
                    f"{timeout_s:g} s ({states}); is each port free, and its cluster bus port (+{BUS_PORT_OFFSET})?"
                )
            time.sleep(0.05)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every node (each flushes its append-only file), wait, then SIGKILL what is left."""
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = {}
        if self._owned_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _port_range(self) -> str:
        return ", ".join(map(str, self.ports))
