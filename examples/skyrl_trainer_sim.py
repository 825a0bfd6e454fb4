"""SkyRL's own fully-async trainer, simulated (`FullyAsyncTrainerSim`, skyrl 0.3.0, unmodified), on `rollout-svc serve`.

`FullyAsyncTrainerSim` is the trainer SkyRL uses to benchmark an inference layer: its fully-async loop (staleness
control, generation buffer, `SkyRLGymGenerator` groups, pause/resume around each weight sync) with each training
step a sleep and no model built. Here it runs against `serve` as SkyRL's external inference layer
(`external_proxy_url`), built through SkyRL's own entrypoint hooks (`BasePPOExp.get_inference_client`,
`get_generator`, `get_tracker`, `get_trainer`), so SkyRL makes its own HTTP calls: per trajectory
`POST /inference/v1/generate` then `POST /finish_session`; per step (and once before the first)
`POST /pause?mode=keep` then `POST /resume`.

Two seams differ from SkyRL's `main_fully_async_sim` entrypoint, both for a CPU host: `_setup_trainer` is not called
(it imports the FSDP worker classes before it knows they are not needed, and they need `flash_attn`, a CUDA build),
and the prompt dataset is filtered in this process (`num_workers=1`; SkyRL's hook spawns 8, ~35 s on 2 cores), with
the data loader in-process too (`data.dataloader.num_workers=0`). Ray is not started: nothing here needs it.

Run against a fleet serving the model whose tokenizer is given (SkyRL's client sends no token, so `serve` opens its
control routes on loopback only when asked)::

    rollout-svc up --workers 2 --engine vllm --dtype float32 &
    rollout-svc serve --port 8000 --open-control &
    python examples/skyrl_trainer_sim.py --url http://127.0.0.1:8000 --steps 4

Prints SkyRL's own step logs, then one JSON line: `steps` (training steps completed), `prompts`, `samples_per_prompt`,
`seconds` (the training loop's wall time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollout_svc.config import Settings
from rollout_svc.integrations.skyrl import skyrl_module
from rollout_svc.model import prepare_model


def gsm8k_rows(n: int) -> list[dict[str, Any]]:
    """n prompts for skyrl-gym's `gsm8k` env, in SkyRL's dataset columns (`prompt`, `env_class`, `reward_spec`)."""
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {a} plus {a + 7}? End with '#### ANSWER'."}],
            "env_class": "gsm8k",
            "reward_spec": {"method": "rule", "ground_truth": str(2 * a + 7)},
        }
        for a in range(n)
    ]


def overrides(args: argparse.Namespace, model_dir: Path, data: Path) -> list[str]:
    """SkyRL's config overrides (its CLI's `key=value` form) for a simulated fully-async run against `args.url`."""
    batch = args.batch_size
    return [
        f"trainer.policy.model.path={model_dir}",
        "trainer.fully_async.enabled=true",
        "trainer.fully_async.simulate_training=true",
        f"trainer.fully_async.simulate_training_step_seconds={args.step_seconds}",
        f"trainer.fully_async.num_parallel_generation_workers={2 * batch}",
        "trainer.fully_async.max_staleness_steps=1",
        f"trainer.train_batch_size={batch}",
        f"trainer.policy_mini_batch_size={batch}",
        "trainer.epochs=1",
        f"trainer.max_training_steps={args.steps}",
        "trainer.eval_interval=-1",
        "trainer.ckpt_interval=-1",
        "trainer.hf_save_interval=-1",
        "trainer.update_ref_every_epoch=false",
        "trainer.resume_mode=none",
        "trainer.placement.colocate_all=false",  # SkyRL refuses external servers when colocated
        "trainer.logger=console",
        "trainer.max_prompt_length=256",
        "trainer.algorithm.policy_loss_type=rollout_is",  # fully async trains on rollout logprobs
        "generator.inference_engine.run_engines_locally=false",
        f"generator.inference_engine.external_proxy_url={args.url}",
        f"generator.inference_engine.external_server_urls=['{args.url}']",
        f"generator.inference_engine.served_model_name={args.served_model_name or model_dir.name}",
        "generator.inference_engine.enable_ray_prometheus_stats=false",
        f"generator.n_samples_per_prompt={args.samples_per_prompt}",
        f"generator.sampling_params.max_generate_length={args.max_tokens}",
        "environment.env_class=gsm8k",
        "data.dataloader.num_workers=0",
        f"data.train_data=['{data}']",
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build SkyRL's config, experiment and `FullyAsyncTrainerSim`, train `args.steps` steps; return the summary."""
    model_dir = Path(args.model) if args.model else prepare_model(Settings().cache_dir)
    config = skyrl_module("skyrl.train.config")
    start_method = multiprocessing.get_start_method(allow_none=True)
    main_base = skyrl_module("skyrl.train.entrypoints.main_base")  # sets the start method to spawn on import
    multiprocessing.set_start_method(start_method, force=True)
    sim = skyrl_module("skyrl.train.fully_async_trainer_sim")
    dataset = skyrl_module("skyrl.train.dataset")

    class SimExperiment(main_base.BasePPOExp):  # type: ignore[misc, name-defined]
        def get_train_dataset(self) -> Any:
            return dataset.PromptDataset(
                datasets=self.cfg.data.train_data,
                tokenizer=self.tokenizer,
                max_prompt_length=self.cfg.trainer.max_prompt_length,
                num_workers=1,
            )

        def get_trainer(
            self,
            cfg: Any,
            tracker: Any,
            tokenizer: Any,
            train_dataset: Any,
            eval_dataset: Any,
            inference_engine_client: Any,
            generator: Any,
            colocate_pg: Any,
        ) -> Any:
            return sim.FullyAsyncTrainerSim(
                cfg=cfg,
                tracker=tracker,
                tokenizer=tokenizer,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                inference_engine_client=inference_engine_client,
                generator=generator,
                colocate_pg=colocate_pg,
            )

    prompts = args.steps * args.batch_size
    with tempfile.TemporaryDirectory(prefix="skyrl-sim-") as tmp:
        data = Path(tmp) / "train.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in gsm8k_rows(prompts)))
        cfg = config.SkyRLTrainConfig.from_cli_overrides(overrides(args, model_dir, data))
        cfg.trainer.export_path = cfg.trainer.ckpt_path = tmp
        main_base.validate_cfg(cfg)
        experiment = SimExperiment(cfg)
        client = experiment.get_inference_client()
        generator = experiment.get_generator(cfg, experiment.tokenizer, client)
        trainer = experiment.get_trainer(
            cfg,
            experiment.get_tracker(),
            experiment.tokenizer,
            experiment.train_dataset,
            experiment.eval_dataset,
            client,
            generator,
            experiment.colocate_pg,
        )
        started = time.monotonic()
        asyncio.run(trainer.train())
        seconds = time.monotonic() - started
    return {
        "steps": trainer.global_step - 1,  # SkyRL counts from 1 and advances past the last step
        "prompts": prompts,
        "samples_per_prompt": args.samples_per_prompt,
        "seconds": round(seconds, 2),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="a `rollout-svc serve --open-control` URL")
    parser.add_argument("--steps", type=int, default=4, help="training steps (each consumes --batch-size prompts)")
    parser.add_argument("--batch-size", type=int, default=2, help="prompts (groups) per step")
    parser.add_argument("--samples-per-prompt", type=int, default=2, help="trajectories per prompt (a group)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per trajectory at most")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="the simulated training step's sleep")
    parser.add_argument("--model", help="the served model's folder (its tokenizer; default: the fleet's model)")
    parser.add_argument("--served-model-name", help="the served model name (default: the model folder's name)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv))))


if __name__ == "__main__":
    sys.exit(main())
