"""The trainer's side of a weight sync on a GPU, with PyTorch alone: what a lent GPU machine can run (no vLLM there).

`python -m rollout_svc.tools.gpu_check` builds a state dict of a model's shape on the device (default Qwen2.5-7B in
bf16: 7.6 B parameters, 15.2 GB, held on the GPU as a trainer holds it), and sends it as `WeightSender` does: the
buckets `plan_buckets` lays out, packed by `WeightSender._send` (each tensor copied from the GPU into kept CPU
buffers) and broadcast over gloo to a receiver in another process on the CPU (`--receive`, started by the check),
which takes them as a worker does (`receive_buckets`) and digests what it got (`weights_digest`): the bytes are
equal when both digests are. Timed beside a bare `tensor.cpu()` of the same tensors, the floor of any copy off the
GPU. Prints one JSON object (`GpuFigures`); `--out FILE` writes it too, which `rollout-svc bench --only gpu` reads.

Without CUDA it runs on the CPU (the same code; what the tests run, on a small shape).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GB = 1e9
BUCKET_BYTES = 256 * 2**20  # Settings().weight_sync.weight_bucket_bytes' default
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ModelShape:
    """A decoder's tensor shapes (Qwen2.5-7B's by default: its config.json): `layers` blocks of attention with
    `heads` query and `kv_heads` key/value heads of `head_dim`, an MLP of `intermediate`, embeddings of `vocab`."""

    layers: int = 28
    hidden: int = 3584
    intermediate: int = 18944
    heads: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 152064

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor, in a Hugging Face checkpoint's order."""
        kv = self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "input_layernorm.weight", (self.hidden,)),
                (p + "self_attn.q_proj.weight", (self.heads * self.head_dim, self.hidden)),
                (p + "self_attn.q_proj.bias", (self.heads * self.head_dim,)),
                (p + "self_attn.k_proj.weight", (kv, self.hidden)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, self.hidden)),
                (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (self.hidden, self.heads * self.head_dim)),
                (p + "post_attention_layernorm.weight", (self.hidden,)),
                (p + "mlp.gate_proj.weight", (self.intermediate, self.hidden)),
                (p + "mlp.up_proj.weight", (self.intermediate, self.hidden)),
                (p + "mlp.down_proj.weight", (self.hidden, self.intermediate)),
            ]
        return [*out, ("model.norm.weight", (self.hidden,)), ("lm_head.weight", (self.vocab, self.hidden))]


@dataclass
class GpuFigures:
    """One run's figures (seconds; `bytes` sent): `bare_cpu_s` every tensor's `.cpu()`, the best of two;
    `pack_s` and `send_s` `WeightSender._send`'s packing into CPU buckets and its broadcast; `receive_s` the
    receiver's, from its first bucket to its last; `digests_equal` whether both ends digest the same bytes."""

    device: str
    torch_version: str
    tensors: int
    bytes: int
    buckets: int
    bare_cpu_s: float
    pack_s: float
    send_s: float
    receive_s: float
    digests_equal: bool

    @property
    def pack_over_bare(self) -> float:
        return self.pack_s / self.bare_cpu_s


def state_dict(shape: ModelShape, device: Any) -> list[tuple[str, Any]]:
    """Seeded bf16 tensors of `shape` on `device`, as a trainer holds its model."""
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    return [
        (name, torch.randn(dims, generator=generator, device=device, dtype=torch.float32).to(torch.bfloat16))
        for name, dims in shape.shapes()
    ]


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_copy_s(tensors: list[tuple[str, Any]]) -> float:
    """Seconds for a bare `.cpu()` of every tensor (the best of two)."""
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        copies = [t.cpu() for _, t in tensors]
        best = min(best, time.perf_counter() - started)
        del copies
    return best


def run_check(shape: ModelShape, device_name: str, bucket_bytes: int = BUCKET_BYTES) -> GpuFigures:
    """Send `shape`'s state dict from `device_name` to a receiver on this host's CPU over gloo (see the module)."""
    import torch

    from rollout_svc.client.weight_sender import WeightSender, _Group
    from rollout_svc.protocol import TransferGroup, WeightManifest
    from rollout_svc.weightsync.transfer import BucketBuffers, join_group, open_store, plan_buckets

    device = torch.device(device_name)
    tensors = state_dict(shape, device)
    _synchronize(device)
    bare_s = bare_copy_s(tensors)
    buckets, sizes = plan_buckets(tensors, bucket_bytes)
    manifest = WeightManifest(sync_id="gpu-check", version=1, bucket_nbytes=sizes, buckets=buckets)
    store = open_store("127.0.0.1", 2, TIMEOUT_S)
    spec = TransferGroup(
        group_id="gpu-check",
        master_addr="127.0.0.1",
        master_port=store.port,
        token=uuid.uuid4().hex,
        world_size=2,
        timeout_s=TIMEOUT_S,
    )
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        orders = Path(folder) / "orders.json"
        orders.write_text(json.dumps({"group": spec.model_dump(mode="json"), "manifest": manifest.model_dump()}))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the receiver is a CPU worker's end
        receiver = subprocess.Popen(
            [sys.executable, "-m", "rollout_svc.tools.gpu_check", "--receive", str(orders)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            group = join_group(spec, 0, "127.0.0.1", store)
            pack_s, send_s, digest = WeightSender._send(
                _Group(spec, {"receiver": 1}, group), buckets, sizes, tensors, BucketBuffers()
            )
            out, _ = receiver.communicate(timeout=TIMEOUT_S)
        finally:
            if receiver.poll() is None:
                receiver.kill()
    if receiver.returncode != 0:
        raise RuntimeError(f"the receiver exited {receiver.returncode}: {out[-2000:]}")
    received = json.loads(out.strip().splitlines()[-1])
    return GpuFigures(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch_version=torch.__version__,
        tensors=len(tensors),
        bytes=sum(sizes),
        buckets=len(sizes),
        bare_cpu_s=bare_s,
        pack_s=pack_s,
        send_s=send_s,
        receive_s=received["receive_s"],
        digests_equal=received["digest"] == digest,
    )


def receive(orders_path: Path) -> dict[str, Any]:
    """The receiving end: join the group as rank 1 on the CPU, take every bucket, digest them."""
    import torch

    from rollout_svc.protocol import TransferGroup, WeightManifest
    from rollout_svc.weightsync.transfer import join_group, receive_buckets, weights_digest

    orders = json.loads(orders_path.read_text())
    spec, manifest = TransferGroup.model_validate(orders["group"]), WeightManifest.model_validate(orders["manifest"])
    targets = [torch.empty(n, dtype=torch.uint8) for n in manifest.bucket_nbytes]
    group = join_group(spec, 1, "127.0.0.1")
    started = time.perf_counter()
    receive_buckets(group, manifest, targets)
    return {"receive_s": time.perf_counter() - started, "digest": weights_digest(targets)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_svc.tools.gpu_check", description=__doc__)
    parser.add_argument("--device", default="", help="cuda or cpu (default: cuda where available)")
    parser.add_argument("--layers", type=int, default=ModelShape.layers, help="decoder blocks (default: 7B's 28)")
    parser.add_argument("--small", action="store_true", help="a small shape (what the tests send on a CPU)")
    parser.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    parser.add_argument("--receive", type=Path, help=argparse.SUPPRESS)  # the receiver the check starts
    args = parser.parse_args(argv)
    if args.receive:
        print(json.dumps(receive(args.receive)))
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = SMALL if args.small else ModelShape(layers=args.layers)
    figures = run_check(shape, device)
    text = json.dumps(asdict(figures) | {"pack_over_bare": figures.pack_over_bare, "shape": asdict(shape)}, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if figures.digests_equal else 1


SMALL = ModelShape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=2048)

if __name__ == "__main__":
    raise SystemExit(main())
