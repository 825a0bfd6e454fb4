"""A minimal, real, fully asynchronous RL loop on CPU: SmolLM2-135M-Instruct learns exact-answer arithmetic.

The loop (one-step off-policy, as in PipelineRL / AReaL with a staleness bound of 1)::

    pending = sample(batch 0)                                # under version v0
    for step s = 1 .. N:
        batch = await pending                                # batch s-1
        1. pending = sample(batch s), in the background      # under v0+s-1, or v0+s once step s has synced
        2. train on batch s-1 in a thread                    # the event loop keeps reading results meanwhile
        3. sender.update(model.named_parameters(), v0+s)     # pause (keep), broadcast, load, commit, resume

So batch s is generated while the trainer works on batch s-1, and a sync may land in the middle of it: a request
in flight then finishes under the new weights (its `weight_versions` record the switch). Every trajectory of
batch s starts at version v0+s-1 or later and is received after at most one more commit, so its staleness (the
client's: the committed version at receipt minus its first token's) is at most 1; the client (`max_staleness=1`)
would regenerate any staler one. Step s trains on versions within {v0+s-2, v0+s-1} ({v0} at step 1), so from
step 3 on never on v0: the newest version per step rises. On a 2-core machine a batch (~8 s) is done long before
training (~15-25 s), so it usually arrives at staleness 0 and is one version behind the trainer when trained on.

Each step line shows `|logprob gap|`: the mean |trainer log-prob - sampling log-prob| per completion token, before
the step. At step 1 both sides hold the same float32 weights and it is ~1e-5 (a wrong sync would show at once);
later it measures how far one update moved the policy.

Task: "What is 7 + 5? Answer with only the number." (digits 1..9), with the assistant's turn prefilled with
"The answer is"; reward 1 if the first integer of the completion is the answer. Each prompt is sampled n times (a
group); advantage = reward - group mean (GRPO without the std, as in Dr. GRPO). The loss is PPO's clipped surrogate
per token, the ratio taken against the sampling log-probs the workers returned, summed over a completion's tokens
and averaged over completions.

Run (starts a private Redis and two float32 vLLM workers, one core each, and stops them at the end)::

    python examples/rl_loop.py --steps 10

or against a running fleet serving the same model (`rollout-svc up --workers 2 --engine vllm --dtype float32`)::

    python examples/rl_loop.py --steps 10 --redis-url redis://127.0.0.1:6379/0

A trainer killed mid-step and restarted (OOM, a preempted node): each batch is sampled as a named step
(`sample(..., step_id=)`), and with `--checkpoint-dir` the trainer checkpoints its model, optimizer, RNG and place
after each step. `--kill-at-step K` runs the trainer as a child process that SIGKILLs itself at the start of step K,
its batch sampled or still sampling on the fleet, then a new trainer process that loads the checkpoint and collects
that batch with `attach_step` (printing `{"attached": step id, "trajectories": B x n}`) instead of sampling it
again, and goes on::

    python examples/rl_loop.py --steps 4 --kill-at-step 3

or, against a running fleet, by hand: `... --redis-url URL --checkpoint-dir ckpt --kill-at-step 3`, then
`... --redis-url URL --checkpoint-dir ckpt --resume`.

Prints one human line and one JSON line per step (`step`, `reward_mean`, `versions`, `staleness_max`,
`sync_s`), then a JSON summary comparing the first and last three steps' mean reward.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from redis.exceptions import ConnectionError as RedisConnectionError

from rollout_svc import RolloutClient, RolloutError, SyncReport, Trajectory, WeightSender
from rollout_svc.config import EngineSettings, Settings

MiB = 2**20
# The assistant's turn starts with this (a prefill): sampled at temperature 1, SmolLM2-135M answered 2 of 48 of these
# problems right when left to start its reply, 16 of 48 after "The answer is"; only a group with mixed rewards
# has a gradient.
ASSISTANT_PREFIX = "The answer is"
CLIP_EPSILON = 0.2  # PPO's clip range of the importance ratio
READY_TIMEOUT_S = 600.0  # two vLLM engines start in ~60 s on 2 cores; the first start after boot is slower
GENERATE_TIMEOUT_S = 300.0


@dataclass
class Problem:
    question: str
    answer: int


@dataclass
class TrainStats:
    loss: float
    logprob_gap: float  # mean |trainer log-prob - sampling log-prob| per token, before the step
    clipped: float  # fraction of tokens whose ratio was outside [1 - CLIP_EPSILON, 1 + CLIP_EPSILON]
    train_s: float


# --- the task -----------------------------------------------------------------------------------------------------


def make_problems(rng: random.Random, count: int) -> list[Problem]:
    """`count` sums of two digits in 1..9 (81 distinct problems)."""
    problems = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        problems.append(Problem(f"What is {a} + {b}? Answer with only the number.", a + b))
    return problems


def reward(text: str, answer: int) -> float:
    """1.0 if the first integer in `text` equals `answer`, else 0.0."""
    match = re.search(r"-?\d+", text)
    return 1.0 if match is not None and int(match.group()) == answer else 0.0


async def sample_batch(
    client: RolloutClient, problems: list[Problem], n: int, max_tokens: int, seed: int, step_id: str
) -> list[list[Trajectory]]:
    """n samples of each problem (B groups of n trajectories), at temperature 1, as the named step `step_id`: if
    this process dies before it collected them, the restarted trainer does (`attached_batch`)."""
    conversations = [[{"role": "user", "content": p.question}] for p in problems]
    [prefix_ids] = await client.tokenize([ASSISTANT_PREFIX], add_special_tokens=False)
    prompts = [chat + prefix_ids for chat in await client.apply_chat_template(conversations)]
    # An explicit seed: both engines run with seed 0, and a group spreads over them. Enqueued in input order (not
    # longest expected first), so a restarted trainer finds group i at samples i*n .. i*n+n-1 of the step.
    params = {"temperature": 1.0, "max_tokens": max_tokens, "seed": seed}
    return await client.sample(
        prompts, n, params, timeout_s=GENERATE_TIMEOUT_S, raise_on_error=True, expected_lengths=False, step_id=step_id
    )


async def attached_batch(
    client: RolloutClient, problems: list[Problem], n: int, step_id: str
) -> list[list[Trajectory]]:
    """The batch an earlier process of this trainer sampled as `step_id` and died before collecting: every
    trajectory, those that arrived meanwhile and those still generating, as `sample_batch`'s groups."""
    flat = await client.attach_step(step_id, timeout_s=GENERATE_TIMEOUT_S, raise_on_error=True)
    print(json.dumps({"attached": step_id, "trajectories": len(flat)}), flush=True)
    return [flat[i * n : (i + 1) * n] for i in range(len(problems))]


# --- the trainer --------------------------------------------------------------------------------------------------


def load_trainer(model_dir: Path) -> torch.nn.Module:
    """The float32 Hugging Face model the workers serve. Exits with a message if it cannot be loaded."""
    from transformers import AutoModelForCausalLM

    if not (model_dir / "config.json").is_file():
        raise SystemExit(
            f"rl_loop: {model_dir} holds no Hugging Face model (no config.json): run `rollout-svc model prepare`, "
            "or pass --model with the folder the workers serve"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise SystemExit(
            f"rl_loop: cannot load the trainer model from {model_dir}: {exc}\n"
            "Run `rollout-svc model prepare`, or pass --model with a Hugging Face folder."
        ) from exc
    model.train()
    return model


def completion_logprobs(model: Any, trajectories: list[Trajectory]) -> list[torch.Tensor]:
    """The model's log-prob of each completion token given its prompt and the tokens before it (teacher forcing).

    One right-padded forward of the decoder over B sequences; the LM head runs on completion positions only.
    Returns B tensors, one entry per completion token.
    """
    sequences = [t.prompt_token_ids + t.completion_token_ids for t in trajectories]
    length = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), length, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), length, dtype=torch.long)
    rows: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    for i, (sequence, t) in enumerate(zip(sequences, trajectories, strict=True)):
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
        attention_mask[i, : len(sequence)] = 1
        start = len(t.prompt_token_ids) - 1  # the position whose logits predict the first completion token
        rows += [i] * len(t.completion_token_ids)
        positions += range(start, start + len(t.completion_token_ids))
        targets += t.completion_token_ids
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    logits = model.get_output_embeddings()(hidden[torch.tensor(rows), torch.tensor(positions)])
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(targets)[:, None]).squeeze(1)
    return list(logprobs.split([len(t.completion_token_ids) for t in trajectories]))


def train_step(
    model: Any, optimizer: torch.optim.Optimizer, groups: list[list[Trajectory]], rewards: list[list[float]]
) -> TrainStats:
    """One clipped policy-gradient step on the groups' own tokens, with the group-mean baseline."""
    started = time.monotonic()
    pairs = [
        (t, r - sum(rs) / len(rs))
        for group, rs in zip(groups, rewards, strict=True)
        for t, r in zip(group, rs, strict=True)
        if t.completion_token_ids
    ]
    trajectories = [t for t, _ in pairs]
    if not trajectories:  # nothing generated: no step
        return TrainStats(0.0, 0.0, 0.0, time.monotonic() - started)
    new = completion_logprobs(model, trajectories)
    total = torch.zeros(())
    gaps, clipped, tokens = 0.0, 0, 0
    for (t, advantage), new_lp in zip(pairs, new, strict=True):
        old_lp = torch.tensor(t.logprobs)
        ratio = torch.exp(new_lp - old_lp)
        bounded = ratio.clamp(1 - CLIP_EPSILON, 1 + CLIP_EPSILON)
        total = total + torch.minimum(ratio * advantage, bounded * advantage).sum()
        gaps += (new_lp.detach() - old_lp).abs().sum().item()
        clipped += int((ratio.detach() != bounded.detach()).sum())
        tokens += len(t.logprobs)
    loss = -total / max(1, len(trajectories))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return TrainStats(loss.item(), gaps / max(1, tokens), clipped / max(1, tokens), time.monotonic() - started)


# --- the loop -----------------------------------------------------------------------------------------------------


@dataclass
class LoopResult:
    rewards: list[float]  # mean reward per step
    staleness: dict[int, int]  # trajectories received at each staleness (the client's count, regenerated included)
    regenerated: int


async def rl_loop(settings: Settings, model: Any, args: argparse.Namespace) -> LoopResult:
    """Run `args.steps` steps (see the module docstring); prints a human line and a JSON line per step. With
    `--checkpoint-dir` the trainer checkpoints after each step; `--resume` goes on from its last checkpoint,
    collecting the batch it had sampled (a named step) rather than sampling it again; `--kill-at-step K` SIGKILLs
    this process at the start of step K, its batch still being sampled or uncollected."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    rng = random.Random(args.seed)
    rewards_per_step: list[float] = []
    checkpoint = TrainerCheckpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    resumed = checkpoint.load(model, optimizer, rng) if checkpoint is not None and args.resume else None
    async with RolloutClient(settings, max_staleness=1) as client, WeightSender(settings=settings) as sender:
        workers = len(await client.workers())
        if workers == 0:
            raise SystemExit(
                f"rl_loop: no live worker at {settings.redis_url}: start some with "
                "`rollout-svc up --workers 2 --engine vllm --dtype float32`, or leave out --redis-url"
            )
        base_version = await sender.committed_version()
        print(f"rl_loop: {workers} workers, committed weight version {base_version}", flush=True)
        run_id = args.run_id

        def start_batch(index: int) -> tuple[list[Problem], asyncio.Task[list[list[Trajectory]]]]:
            problems = make_problems(rng, args.batch)
            seed = args.seed * 1_000_000 + index * args.n
            step_id = f"{run_id}-batch-{index}"
            return problems, asyncio.create_task(sample_batch(client, problems, args.n, args.max_tokens, seed, step_id))

        first = 1
        if resumed is None:
            problems, pending = start_batch(0)
        else:  # the batch the dead process sampled, collected where it is: nothing is generated twice
            first, base_version, run_id = resumed.step + 1, resumed.base_version, resumed.run_id
            problems, rewards_per_step = resumed.problems, resumed.rewards
            step_id = f"{run_id}-batch-{resumed.step}"
            pending = asyncio.create_task(attached_batch(client, problems, args.n, step_id))
            print(f"rl_loop: resumed after step {resumed.step} from {args.checkpoint_dir}", flush=True)
        if checkpoint is not None and resumed is None:
            checkpoint.save(model, optimizer, rng, LoopState(run_id, 0, base_version, problems, rewards_per_step))
        try:
            for step in range(first, args.steps + 1):
                if step == args.kill_at_step:
                    print(f"rl_loop: killing this trainer (SIGKILL) at the start of step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                waited = time.monotonic()
                groups, batch_problems = await pending, problems  # batch step-1, sampled while step-1 trained
                wait_s = time.monotonic() - waited
                # 1. Sample the next batch while this one trains: the overlap that makes the loop asynchronous.
                if step < args.steps:
                    problems, pending = start_batch(step)
                # 2. Train on this batch in a thread: the event loop keeps reading the next batch's results.
                rewards = [[reward(t.text, p.answer) for t in g] for g, p in zip(groups, batch_problems, strict=True)]
                stats = await asyncio.to_thread(train_step, model, optimizer, groups, rewards)
                # 3. Push the new weights: in-flight requests of the next batch freeze, then go on under them.
                report = await sender.update(model.named_parameters(), version=base_version + step)
                rewards_per_step.append(report_step(step, groups, rewards, stats, report, wait_s))
                if checkpoint is not None and step < args.steps:
                    state = LoopState(run_id, step, base_version, problems, rewards_per_step)
                    await asyncio.to_thread(checkpoint.save, model, optimizer, rng, state)
                # Trained on and checkpointed: a restart no longer needs batch step-1, whose results Redis kept.
                await client.finish_step(f"{run_id}-batch-{step - 1}")
        finally:
            if not pending.done():
                pending.cancel()  # cancels its requests on the workers, queued and in flight
                await asyncio.gather(pending, return_exceptions=True)
        stats_seen = client.stats
    return LoopResult(rewards_per_step, dict(sorted(stats_seen.staleness.items())), stats_seen.regenerated)


def report_step(
    step: int,
    groups: list[list[Trajectory]],
    rewards: list[list[float]],
    stats: TrainStats,
    report: SyncReport,
    wait_s: float,
) -> float:
    """Print the step's human line and JSON line; return its mean reward."""
    trajectories = [t for g in groups for t in g]
    flat = [r for rs in rewards for r in rs]
    reward_mean = sum(flat) / len(flat)
    versions = sorted({t.weight_version for t in trajectories})
    staleness_max = max(t.staleness or 0 for t in trajectories)
    switched = sum(len(t.weight_versions) > 1 for t in trajectories)
    tokens = sum(len(t.completion_token_ids) for t in trajectories)
    print(
        f"step {step}: reward {reward_mean:.3f} ({int(sum(flat))}/{len(flat)}), versions {versions} "
        f"({switched} switched mid-completion), staleness <= {staleness_max}, {tokens} tokens; "
        f"loss {stats.loss:+.4f}, |logprob gap| {stats.logprob_gap:.2e}, clipped {stats.clipped:.1%}; "
        f"waited {wait_s:.1f} s for the batch, trained {stats.train_s:.1f} s, "
        f"synced v{report.version} in {report.total_s:.2f} s ({report.gb_per_s:.2f} GB/s, {len(report.loaded)} loaded)",
        flush=True,
    )
    line = {
        "step": step,
        "reward_mean": reward_mean,
        "versions": versions,
        "staleness_max": staleness_max,
        "sync_s": report.total_s,
    }
    print(json.dumps(line), flush=True)
    return reward_mean


# --- a trainer killed mid-step and restarted ----------------------------------------------------------------------


@dataclass
class LoopState:
    """Where the loop is after `step` steps (0: none yet): its run's id (its batches' step ids), the version it
    started from, the problems of the batch being sampled (batch `step`), and the mean reward of each step so far."""

    run_id: str
    step: int
    base_version: int
    problems: list[Problem]
    rewards: list[float]


class TrainerCheckpoint:
    """The trainer's model, optimizer, RNG and `LoopState` in a folder of its own, written after each step. The
    tensors go through `torch.save` and come back with `torch.load(weights_only=True)` (tensors and plain values
    only, never arbitrary objects); the loop state and RNG as JSON, written last: a checkpoint without it is none."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def save(self, model: Any, optimizer: torch.optim.Optimizer, rng: random.Random, state: LoopState) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tensors = self.folder / "trainer.pt"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{tensors}.tmp")
        os.replace(f"{tensors}.tmp", tensors)
        version, internal, gauss = rng.getstate()
        loop = {
            "run_id": state.run_id,
            "step": state.step,
            "base_version": state.base_version,
            "problems": [[p.question, p.answer] for p in state.problems],
            "rewards": state.rewards,
            "rng": [version, list(internal), gauss],
        }
        (self.folder / "loop.json.tmp").write_text(json.dumps(loop))
        os.replace(self.folder / "loop.json.tmp", self.folder / "loop.json")

    def load(self, model: Any, optimizer: torch.optim.Optimizer, rng: random.Random) -> LoopState:
        """Restore model, optimizer and RNG; the loop's state. Exits with a message if there is no checkpoint."""
        if not (self.folder / "loop.json").is_file():
            raise SystemExit(f"rl_loop: no checkpoint in {self.folder} to resume from (--checkpoint-dir)")
        loop = json.loads((self.folder / "loop.json").read_text())
        saved = torch.load(self.folder / "trainer.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        version, internal, gauss = loop["rng"]
        rng.setstate((version, tuple(internal), gauss))
        problems = [Problem(question, answer) for question, answer in loop["problems"]]
        return LoopState(loop["run_id"], loop["step"], loop["base_version"], problems, loop["rewards"])


def killed_and_resumed(settings: Settings, args: argparse.Namespace) -> int:
    """`--kill-at-step` on a fleet this process started: run the trainer as a child process that kills itself at
    that step, then a new one that resumes from its checkpoint; the fleet (and the batch it was sampling) lives on."""
    folder = Path(args.checkpoint_dir or tempfile.mkdtemp(prefix="rl_loop-checkpoint-"))
    common = [sys.executable, __file__, "--redis-url", settings.redis_url, "--checkpoint-dir", str(folder)]
    common += ["--steps", str(args.steps), "--batch", str(args.batch), "--n", str(args.n)]
    common += ["--max-tokens", str(args.max_tokens), "--lr", str(args.lr), "--seed", str(args.seed)]
    common += ["--threads", str(args.threads), "--run-id", args.run_id]
    if args.model is not None:
        common += ["--model", str(args.model)]
    first = subprocess.run([*common, "--kill-at-step", str(args.kill_at_step)], check=False)
    print(json.dumps({"trainer_exit": first.returncode, "killed_at_step": args.kill_at_step}), flush=True)
    if first.returncode != -signal.SIGKILL:
        return first.returncode or 1
    return subprocess.run([*common, "--resume"], check=False).returncode


# --- the fleet ----------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalFleet(AbstractContextManager[Settings]):
    """A private Redis and `workers` float32 vLLM workers (the CPUs split among them); stopped on leaving."""

    def __init__(self, model_dir: Path, workers: int, log_dir: Path) -> None:
        from rollout_svc.deploy.local import LocalCluster

        # A longer heartbeat TTL keeps a worker starved of CPU by the trainer from being taken for dead
        # (LocalCluster hands these settings to the workers).
        self.settings = Settings(
            redis_url=f"redis://127.0.0.1:{free_port()}/0", control_timeout_s=120, heartbeat_ttl_s=30
        )
        engine = EngineSettings(model=str(model_dir), dtype="float32", max_num_seqs=64, kv_cache_memory_bytes=256 * MiB)
        self.cluster = LocalCluster(self.settings, workers=workers, engine=engine, log_dir=log_dir)

    def __enter__(self) -> Settings:
        started = time.monotonic()
        try:
            self.cluster.start()
            self.cluster.wait_ready(timeout_s=READY_TIMEOUT_S)
        except BaseException as exc:
            self.cluster.stop()
            if isinstance(exc, RuntimeError):
                raise SystemExit(f"rl_loop: the local cluster did not start: {exc}") from exc
            raise
        print(f"rl_loop: {self.cluster.worker_count} vLLM workers up in {time.monotonic() - started:.0f} s", flush=True)
        return self.settings

    def __exit__(self, *exc_info: object) -> None:
        self.cluster.stop()


# --- main ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True, help="RL steps (each: one batch, one update)")
    parser.add_argument("--redis-url", help="use the fleet behind this Redis (default: start a local one)")
    parser.add_argument("--model", type=Path, help="HF folder the workers serve (default: the prepared SmolLM2)")
    parser.add_argument("--batch", type=int, default=8, help="problems per step")
    parser.add_argument("--n", type=int, default=4, help="samples per problem (a group)")
    parser.add_argument("--max-tokens", type=int, default=8, help="completion tokens at most")
    parser.add_argument("--lr", type=float, default=2e-6, help="Adam learning rate")
    parser.add_argument("--workers", type=int, default=2, help="local workers (without --redis-url)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, help="checkpoint the trainer here after each step")
    parser.add_argument("--resume", action="store_true", help="go on from --checkpoint-dir's last checkpoint")
    parser.add_argument("--kill-at-step", type=int, help="SIGKILL the trainer at the start of this step, then resume")
    parser.add_argument("--run-id", default=f"rl-loop-{int(time.time())}", help="names each batch's step")
    args = parser.parse_args(argv)
    if args.kill_at_step is not None and not 1 < args.kill_at_step <= args.steps:
        parser.error("--kill-at-step must be in 2 .. --steps (step 1 has nothing to resume from)")
    if (args.resume or (args.kill_at_step and args.redis_url)) and args.checkpoint_dir is None:
        parser.error("--resume, and --kill-at-step with --redis-url, need --checkpoint-dir")
    if args.steps < 1 or args.batch < 1 or args.n < 2 or args.max_tokens < 1:
        parser.error("--steps, --batch and --max-tokens must be >= 1, --n >= 2 (a group needs a baseline)")
    return args


def model_folder(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    from rollout_svc.model import prepare_model

    try:
        return prepare_model(Settings().cache_dir)
    except ModuleNotFoundError as exc:
        raise SystemExit(f"rl_loop: cannot prepare the default model: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the `finally`s: the fleet stops with us
    started = time.monotonic()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = model_folder(args)
    model = load_trainer(model_dir)  # before the fleet: a model that cannot load fails in seconds, not minutes
    log_dir = None if args.redis_url else Path(tempfile.mkdtemp(prefix="rl_loop-logs-"))
    fleet: AbstractContextManager[Settings]
    if log_dir is None:
        fleet = nullcontext(Settings(redis_url=args.redis_url))
    else:
        fleet = LocalFleet(model_dir, args.workers, log_dir)
    try:
        with fleet as settings:
            if args.kill_at_step is not None and log_dir is not None:
                return killed_and_resumed(settings, args)
            result = asyncio.run(rl_loop(settings, model, args))
    except RedisConnectionError as exc:
        print(f"rl_loop: cannot reach Redis ({exc}); is --redis-url right?", file=sys.stderr)
        return 1
    except RolloutError as exc:
        where = f" (worker logs: {log_dir})" if log_dir else ""
        print(f"rl_loop: {type(exc).__name__}: {exc}{where}", file=sys.stderr)
        return 1
    if log_dir is not None:
        shutil.rmtree(log_dir, ignore_errors=True)  # kept after a failure
    summarize(result, time.monotonic() - started)
    return 0


def summarize(result: LoopResult, wall_s: float) -> None:
    first, last = result.rewards[:3], result.rewards[-3:]
    first_mean, last_mean = sum(first) / len(first), sum(last) / len(last)
    print(
        f"mean reward: first {len(first)} steps {first_mean:.3f}, last {len(last)} steps {last_mean:.3f}; "
        f"staleness counts {result.staleness}, {result.regenerated} regenerated; {wall_s:.0f} s in all",
        flush=True,
    )
    summary = {
        "first3_reward_mean": first_mean,
        "last3_reward_mean": last_mean,
        "staleness_counts": {str(k): v for k, v in result.staleness.items()},
        "regenerated": result.regenerated,
        "wall_s": wall_s,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":  # vLLM's workers spawn processes: nothing may run on import
    sys.exit(main())
