"""Redis ACL users of a deployment (`producer`, `worker`, `admin`): their rules, computed from `Keys`; creating them.

Redis is the service's other door: whoever can write the state hash steers the fleet. Three users split it:

- `producer` (a `RolloutClient`, the API's callers): the data plane. It enqueues (the placement script reads the
  workers set and heartbeats and writes the request streams, session pins and session sets), reads and deletes
  its results, reads the state hash (the committed weight version), writes cancel tombstones and publishes the
  cancel nudge. It cannot write the state hash or the command log, publish on the control, acks or weights
  channels, read or write the weight-sync keys (the sync order holds the transfer group's one-time token), add to
  a results stream (forge a result), delete a requests stream, or create a key of another type than the one the
  workers expect there (each of its selectors holds keys of one type).
- `worker` (`python -m workers`): take, ack, publish results, heartbeats, reaping (the reap locks), dead letters,
  session pins; reads the state hash, the command log and the tombstones, and may only *add* missing fields to the
  state hash (HSETNX: the re-seed of a Redis that forgot, DESIGN.md section 4); reads the sync order and the
  manifest and writes the weight-sync barriers and the peer catch-up orders and answers (workers send each other the
  committed version); listens on the control, cancel and weights channels (it nudges a peer on the last) and
  announces on the acks channel.
- `admin` (the operator, `rollout-svc status` and the control commands, the trainer's `WeightSender`, the API):
  every key and channel under the prefix, every command but Redis' `@dangerous` ones.

Redis 7 checks a script's every `redis.call` against the caller's user, so the scripts need no rules of their own;
but it also checks the EVALSHA call itself as if it wrote every key it declares. A selector (`(+evalsha ~...)`)
lets a role pass that outer check for the keys it may at least read; what the script then does is checked
command by command against the role's own rules. Needs Redis >= 7.0 (selectors, `%R~`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from redis.exceptions import NoPermissionError, ResponseError

from rollout_svc.keys import JOINED, LOADED, RECEIVED, Keys

PRODUCER, WORKER, ADMIN = "producer", "worker", "admin"
PASSWORD_BYTES = 32  # secrets.token_urlsafe: 43 URL-safe characters, 256 bits

# AUTH, HELLO, PING, SELECT, CLIENT ID / SETNAME / SETINFO ...; not CLIENT KILL, PAUSE, LIST or UNBLOCK.
_CONNECTION = ("+@connection", "-@dangerous")
_READ_FLEET = ("+exists", "+hget", "+hmget", "+hgetall", "+smembers", "+scard", "+sismember")
_WORKER_COMMANDS = (
    *_CONNECTION,
    "+client|unblock",  # a pause unblocks the worker's own blocking read at once
    "+script|load", "+evalsha", "+time",  # the placement scripts read the clock
    *_READ_FLEET,
    "+xgroup|create", "+xgroup|delconsumer", "+xinfo|groups", "+xreadgroup", "+xpending", "+xrange", "+xlen",
    "+xack", "+xdel", "+xadd", "+del", "+expire", "+pexpire",  # take, publish, requeue, dead letters
    "+get", "+set", "+hset", "+sadd", "+srem",  # heartbeats, reap locks, barriers, session pins
    "+hincrby", "+hdel",  # the loads placement shares work by (Keys.loads)
    "+zadd", "+zrem", "+zcard", "+zremrangebyscore", "+zrangebyscore",  # session sets, command log, tombstones
    "+zrange", "+zcount", "+zmscore",  # the open workers by level (Keys.levels, Keys.open_at)
    "+rpush", "+lrange", "+ltrim", "+llen", "+lindex", "+lrem",  # the queued costs (Keys.queued_costs)
    "+multi", "+exec", "+subscribe", "+unsubscribe", "+publish",
)  # fmt: skip
_ADMIN_COMMANDS = ("+@all", "-@dangerous")  # no FLUSHALL, KEYS, CONFIG, ACL, CLIENT KILL, MONITOR, SHUTDOWN ...


@dataclass(frozen=True)
class Grant:
    """Commands (rules like `+xadd`, `-@dangerous`, in order) allowed on key patterns read-write or read-only."""

    commands: tuple[str, ...]
    read_write: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()

    def rules(self) -> list[str]:
        return [*self.commands, *(f"~{p}" for p in self.read_write), *(f"%R~{p}" for p in self.read_only)]


@dataclass(frozen=True)
class Role:
    """One Redis user: its root grant, its pub/sub channels, and selectors (grants of their own). Redis allows a
    command if the root or any one selector allows it whole: the command and every key it names."""

    name: str
    root: Grant
    channels: tuple[str, ...] = ()
    selectors: tuple[Grant, ...] = ()

    def rules(self) -> list[str]:
        """The ACL SETUSER rules (Redis 7 syntax) that follow `reset on >password`."""
        rules = ["-@all", *self.root.rules(), *(f"&{c}" for c in self.channels)]
        return rules + ["(" + " ".join(selector.rules()) + ")" for selector in self.selectors]


def glob_escape(text: str) -> str:
    """`text` as a literal in a Redis glob pattern (key and channel patterns of ACL rules)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def roles(keys: Keys) -> dict[str, Role]:
    """The three roles for the key names of `keys` (its prefix, the deployment's `key_prefix`): {name: Role},
    producer, worker, admin. Producer and worker have the same rights on every named model's keys
    (`{prefix}:model:{name}:...`, `Settings.model_name`) as on the default model's, and the worker may add its model
    to the set of named models (`{prefix}:models`), which a producer may read."""
    prefix = glob_escape(keys.prefix)
    k = Keys(prefix, "*")  # every name below is a pattern; `*` stands for an id (and a shard)
    named = Keys(f"{prefix}:model:*", "*")  # ... and here for a model's name too
    models = f"{prefix}:models"
    producer = _merged(_producer(k), _producer(named), Grant(("+smembers",), read_only=(models,)))
    worker = _merged(_worker(k), _worker(named))
    worker = Role(
        WORKER,
        Grant(worker.root.commands, (*worker.root.read_write, models), worker.root.read_only),
        worker.channels,
        worker.selectors,
    )
    return {PRODUCER: producer, WORKER: worker, ADMIN: _admin(k)}


def _merged(default: Role, named: Role, *extra: Grant) -> Role:
    """`default`'s rights and `named`'s (the same role over other key patterns) in one role; `extra` selectors added.
    Each selector still holds keys of one type: the same selector of both, over both patterns."""

    def both(a: Grant, b: Grant) -> Grant:
        return Grant(a.commands, (*a.read_write, *b.read_write), (*a.read_only, *b.read_only))

    selectors = tuple(both(a, b) for a, b in zip(default.selectors, named.selectors, strict=True))
    channels = (*default.channels, *named.channels)
    return Role(default.name, both(default.root, named.root), channels, (*selectors, *extra))


def _producer(k: Keys) -> Role:
    """Each selector holds keys of one type, so a producer cannot create a key of the wrong type where a worker
    expects another (a string where the tombstones' sorted set belongs would stop the workers' control loops)."""
    requests = (k.requests, k.pinned_requests("*"), k.token_requests)
    grants = (
        Grant(("+xadd", "+xlen", "+xrange", "+xpending", "+xdel"), requests),  # enqueue, the cancel sweep
        # its results (no XADD: it cannot forge one); EXPIRE: a named step's are kept while the step lives
        Grant(("+xread", "+xdel", "+del", "+expire"), (k.results("*"),)),
        Grant(("+get", "+set", "+del"), (k.session("*"),)),  # session pins
        Grant(("+zadd", "+zrem", "+zcard", "+zcount", "+zremrangebyscore"), (k.worker_sessions("*"), k.cancelled)),
        Grant(_READ_FLEET, read_only=(k.state, k.workers, k.worker("*"))),  # placement, `workers()`, weight version
        Grant(("+smembers",), read_only=(k.shards,)),  # the shards to place requests on
        # a new session's worker: the least loaded open one (Keys.levels), and its level and the sums kept
        Grant(("+hget", "+hmget", "+hgetall", "+hincrby", "+hset", "+hdel"), (k.loads,)),
        Grant(("+zadd", "+zrem", "+zrange", "+zcount", "+zrangebyscore"), (k.levels, k.open_at)),
        Grant(("+rpush", "+lrem"), (k.queued_costs,)),  # the costs of what it queued (and swept) in the shared stream
        # named steps: their records, the index of them by expiry, the count of those that expired
        Grant(("+hset", "+hsetnx", "+hgetall", "+del", "+expire", "+exists"), (k.step("*"),)),
        Grant(("+zadd", "+zrem", "+zrangebyscore"), (k.steps,)),
        Grant(("+incrby", "+get"), (k.steps_expired,)),
    )
    declared = tuple(p for grant in grants for p in (*grant.read_write, *grant.read_only))
    evalsha = Grant(("+evalsha",), declared)  # passes EVALSHA's own check; each redis.call is checked by the rest
    root = Grant((*_CONNECTION, "+script|load", "+time", "+publish"))  # the clock (scripts); the cancel nudge
    return Role(PRODUCER, root, channels=(k.cancel_channel,), selectors=(*grants, evalsha))


def _worker(k: Keys) -> Role:
    streams = (k.requests, k.pinned_requests("*"), k.token_requests, k.results("*"), k.dead)
    barriers = tuple(k.weight_barrier("*", phase) for phase in (JOINED, RECEIVED, LOADED))
    fleet: tuple[str, ...] = (k.session("*"), k.worker_sessions("*"), k.workers, k.worker("*"), k.reap_lock("*"))
    fleet += (k.shards, *k.load_keys)  # the loads, the open workers by level (`dataplane.levels`), queued costs
    fleet += (k.reap_turn,)
    catch_ups = (k.weight_catch_ups, k.weight_catch_up_answer("*"))  # peer catch-up, among workers
    read_write = (*streams, *fleet, *barriers, *catch_ups)
    read_only = (k.state, k.commands, k.cancelled, k.weight_sync, k.weight_manifest("*"), k.weight_load("*"))
    return Role(
        WORKER,
        Grant(_WORKER_COMMANDS, read_write, read_only),
        channels=(k.control_channel, k.cancel_channel, k.weights_channel, k.acks_channel),
        selectors=(
            Grant(("+evalsha",), (*read_write, *read_only)),
            Grant(("+hsetnx",), (k.state,)),  # the re-seed: adds missing fields, never changes one
        ),
    )


def _admin(k: Keys) -> Role:
    return Role(ADMIN, Grant(_ADMIN_COMMANDS, (f"{k.prefix}:*",)), channels=(f"{k.prefix}:*",))


def setuser_args(role: Role, password: str) -> list[str]:
    """The arguments of `ACL SETUSER` that (re)define `role` with `password` (and no other)."""
    return ["ACL", "SETUSER", role.name, "reset", "on", f">{password}", *role.rules()]


def redis_cli_line(args: list[str]) -> str:
    """One command as `redis-cli` reads it from stdin: arguments holding spaces, quotes or backslashes quoted."""

    def quoted(arg: str) -> str:
        if not re.search(r"[\s\"'\\]", arg):
            return arg
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return " ".join(quoted(arg) for arg in args)


def new_password() -> str:
    """A strong random password (`secrets`, 256 bits, URL-safe: it needs no quoting in a Redis URL)."""
    return secrets.token_urlsafe(PASSWORD_BYTES)


def user_url(url: str, user: str, password: str) -> str:
    """`url` (redis:// or rediss://, any host, port and db) with `user:password@` in place of its credentials."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))


@dataclass(frozen=True)
class Credentials:
    """The Redis URLs of the three users, `redis://user:password@host:port/db`."""

    producer: str
    worker: str
    admin: str

    def write(self, path: Path) -> None:
        """Write them to `path` as JSON ({"producer": url, "worker": url, "admin": url}), readable by the owner
        only (mode 0600, also when the file existed). Raises `OSError` if it cannot be written."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o600)
            json.dump(asdict(self), out, indent=2)
            out.write("\n")

    @classmethod
    def read(cls, path: Path) -> Credentials:
        """The credentials `write` wrote. Raises `OSError`, or `ValueError` / `TypeError` for another file."""
        return cls(**json.loads(path.read_text()))


def create_users(client: redis.Redis, keys: Keys, url: str, *, disable_default: bool = True) -> Credentials:
    """Create (or redefine) `producer`, `worker` and `admin` on the Redis `client` talks to, each with a fresh
    password, and return their URLs (`url` with each user's credentials). With `disable_default`, the `default`
    user is turned off last: new anonymous connections can do nothing (open ones, this client's included, stay
    authenticated until they close).

    `client` needs the right to run ACL SETUSER (the default user of a fresh Redis has it). Raises
    `redis.exceptions.ResponseError` if Redis refuses (a Redis older than 7.0 knows no selectors nor `%R~`).
    """
    passwords = {}
    for name, role in roles(keys).items():
        passwords[name] = new_password()
        client.execute_command(*setuser_args(role, passwords[name]))
    if disable_default:
        client.execute_command("ACL", "SETUSER", "default", "off")
    return Credentials(**{name: user_url(url, name, password) for name, password in passwords.items()})


def permission_denied(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing a command for lack of ACL permission: `NoPermissionError` (NOPERM) for a
    command sent directly, or the error of a script whose `redis.call` was refused ("The user executing the
    script can't ...", which redis-py raises as a plain `ResponseError`)."""
    if isinstance(exc, NoPermissionError):
        return True
    text = str(exc)
    return isinstance(exc, ResponseError) and ("NOPERM" in text or "user executing the script can't" in text)
