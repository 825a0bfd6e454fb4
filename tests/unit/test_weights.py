"""Weight sync's pure parts: bucket packing, version spans, the checkpoint root, the wire messages."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from rollout_svc.dataplane.streams import Entry
from rollout_svc.errors import InvalidRequestError, ProtocolError
from rollout_svc.protocol import (
    Continuation,
    RolloutRequest,
    SamplingParams,
    TensorSpec,
    Trajectory,
    WeightManifest,
    decode,
    encode,
)
from rollout_svc.weightsync.plane import await_stable, checkpoint_dir, checkpoint_files
from rollout_svc.weightsync.transfer import ALIGN_BYTES, fill_into, plan_buckets, torch_dtype, unpack_bucket
from workers.inflight import InFlight
from workers.serve import weight_spans


def test_buckets_round_trip_every_dtype_and_respect_the_size():
    named = [
        ("a", torch.randn(100, 10)),
        ("b", torch.randn(33).to(torch.bfloat16)),
        ("c", torch.arange(17, dtype=torch.int64)),
        ("d", torch.randn(3, 5).to(torch.float16)),
        ("big", torch.randn(2000)),
    ]
    buckets, sizes = plan_buckets(named, bucket_bytes=4096)
    assert [[s.name for s in b] for b in buckets] == [["a"], ["b", "c", "d"], ["big"]]
    assert all(s.offset % ALIGN_BYTES == 0 for b in buckets for s in b)
    assert sizes[0] == 4000 and sizes[2] == 8000, "one tensor larger than a bucket gets a bucket of its own"
    by_name = dict(named)
    received = []
    for specs, nbytes in zip(buckets, sizes, strict=True):
        buffer = fill_into(torch.empty(nbytes, dtype=torch.uint8), specs, [by_name[s.name] for s in specs])
        announced = decode(encode(WeightManifest(sync_id="s", version=1, bucket_nbytes=[nbytes], buckets=[specs])))
        received += unpack_bucket(buffer, announced.buckets[0])  # the specs as a receiver reads them
    assert [name for name, _ in received] == [name for name, _ in named]
    for name, tensor in received:
        assert tensor.dtype == by_name[name].dtype and torch.equal(tensor, by_name[name])


def test_a_transposed_tensor_and_a_parameter_that_requires_grad_pack_as_their_values():
    """The CPU pack copies through numpy (one thread): a non-contiguous view and a trainer's parameter (numpy refuses
    a tensor that requires grad) still arrive as their values."""
    named = [("t", torch.randn(4, 6).t()), ("p", torch.nn.Parameter(torch.randn(5, 3).to(torch.bfloat16)))]
    [specs], [nbytes] = plan_buckets(named, bucket_bytes=4096)
    buffer = fill_into(torch.zeros(nbytes, dtype=torch.uint8), specs, [t for _, t in named])
    received = dict(unpack_bucket(buffer, specs))
    assert torch.equal(received["t"], named[0][1]) and torch.equal(received["p"], named[1][1].detach())


def test_the_digest_of_cpu_buckets_is_the_wrapping_block_sums_torch_computes_on_any_device():
    """`weights_digest` sums CPU buckets with numpy (one thread) and others with torch: both must give the same
    digest for the same bytes (a GPU trainer and a CPU worker compare digests). The reference here is torch's sum,
    on buckets whose int64 block sums overflow and wrap, one starting at an offset that is not 8-byte aligned, and
    tails shorter than a block."""
    import hashlib

    from rollout_svc.weightsync.transfer import DIGEST_BLOCK_BYTES, weights_digest

    generator = torch.Generator().manual_seed(0)
    backing = torch.randint(0, 256, (3 * DIGEST_BLOCK_BYTES + 13,), dtype=torch.uint8, generator=generator)
    buckets = [
        torch.full((2 * DIGEST_BLOCK_BYTES + 5,), 255, dtype=torch.uint8),  # -1 as int64, summed: no overflow
        torch.randint(0, 256, (5 * DIGEST_BLOCK_BYTES,), dtype=torch.uint8, generator=generator),  # sums wrap
        backing[3:],  # unaligned
        torch.randint(0, 256, (100,), dtype=torch.uint8, generator=generator),  # a tail only
    ]
    reference = hashlib.blake2b(digest_size=16)
    for bucket in buckets:
        whole = bucket.numel() // DIGEST_BLOCK_BYTES * DIGEST_BLOCK_BYTES
        reference.update(bucket.numel().to_bytes(8, "little"))
        if whole:
            sums = bucket[:whole].clone().view(torch.int64).view(-1, DIGEST_BLOCK_BYTES // 8).sum(dim=1)
            reference.update(sums.numpy().tobytes())
        reference.update(bucket[whole:].numpy().tobytes())
    assert weights_digest(buckets) == reference.hexdigest()
    flipped = [b.clone() for b in buckets]
    flipped[1][7] ^= 1
    assert weights_digest(flipped) != reference.hexdigest()


def test_a_receive_never_writes_into_the_buckets_held_or_being_sent():
    """`ReceivingEnd` receives into a kept set of buffers other than the held version's and those lent to a sender:
    two sets are kept (no page faults after the second sync), a third is made, not kept, only while both are in
    use; another model's sizes start over."""
    from rollout_svc.weightsync.transfer import BucketBuffers

    cpu, buffers = torch.device("cpu"), BucketBuffers()
    first = buffers.get([64, 32], cpu)
    assert buffers.get([64, 32], cpu) is first, "kept: the same set when nothing is in use"
    second = buffers.get([64, 32], cpu, avoid=[first])
    assert second is not first and buffers.get([64, 32], cpu, avoid=[second]) is first
    third = buffers.get([64, 32], cpu, avoid=[first, second])
    assert third is not first and third is not second
    assert buffers.get([64, 32], cpu, avoid=[first, second]) is not third, "a third set is not kept"
    other = buffers.get([128], cpu, avoid=[first])
    assert other is not first and other is not second and other[0].numel() == 128, "other sizes: new buffers"


class _Sent:
    """A transfer group whose broadcasts deliver the packed buckets of `tensors` (what the trainer would send)."""

    def __init__(self, tensors: dict[str, torch.Tensor], specs: list[list[TensorSpec]]) -> None:
        self.tensors, self.specs, self.at = tensors, specs, 0

    def broadcast(self, buffer: torch.Tensor, root: int) -> _Sent:
        specs = self.specs[self.at]
        fill_into(buffer, specs, [self.tensors[s.name] for s in specs])
        self.at += 1
        return self

    def wait(self) -> None:
        pass


def test_the_version_loaded_before_stays_loadable_until_a_receive_takes_its_buffers():
    """A broadcast loaded over another (`LoadedFrom.switched`) keeps the one before in the other pooled set, so it
    can be loaded again if the newer one is never committed; the next receive takes those buffers and drops it."""
    from rollout_svc.weightsync.transfer import LoadedFrom, ReceivingEnd

    def receive(end: ReceivingEnd, version: int) -> dict[str, torch.Tensor]:
        tensors = {"a": torch.full((8,), float(version)), "b": torch.arange(4) * version}
        specs, sizes = plan_buckets(list(tensors.items()), 32)
        end.group = _Sent(tensors, specs)
        end.receive(WeightManifest(sync_id=f"s{version}", version=version, bucket_nbytes=sizes, buckets=specs))
        return tensors

    end, loads = ReceivingEnd(), LoadedFrom()
    with pytest.raises(RuntimeError, match="no previous"):
        loads.again("previous")
    one = receive(end, 1)
    loads.switched(end, "trainer")
    receive(end, 2)
    loads.switched(end, "trainer")
    again_end, tensors = loads.again("previous")
    assert again_end is end and all(torch.equal(one[n], t) for n, t in tensors), "version 1, whole"
    loads.switched(end, "previous")
    assert end.held is not None and end.held.manifest.version == 1 and end.previous is None
    assert [n for n, _ in end.held_tensors()] == ["a", "b"]
    receive(end, 3)  # into the buffers version 2 had: version 1 (held) stays whole
    assert torch.equal(dict(end.held_tensors())["a"], one["a"])
    loads.switched(end, "trainer")
    receive(end, 4)  # into version 1's buffers: it is no longer loadable
    with pytest.raises(RuntimeError, match="no previous"):
        loads.again("previous")


def test_a_manifest_with_an_unknown_dtype_is_refused():
    with pytest.raises(ProtocolError, match="unknown tensor dtype"):
        torch_dtype("Tensor")


def record(start: int, marks: list[tuple[int, int]], kept: int = 0) -> InFlight:
    continuation = Continuation(retry_of="r0", token_ids=[7] * kept, logprobs=[0.0] * kept) if kept else None
    request = RolloutRequest(
        request_id="r1",
        prompt_token_ids=[1, 2],
        sampling_params=SamplingParams(max_tokens=64),
        reply_to="results",
        continuation=continuation,
    )
    r = InFlight(Entry("stream", b"1-0", b"", 1, None, 0), generation=True, request=request)
    r.start_version, r.version_marks = start, marks
    return r


@pytest.mark.parametrize(
    ("prior", "start", "marks", "kept", "total", "spans"),
    [
        ([], 3, [], 0, 10, [(3, 0)]),  # one version throughout
        ([], 3, [(4, 6)], 0, 10, [(3, 0), (4, 6)]),  # a keep-pause across a sync at token 6
        ([], 3, [(4, 0)], 0, 10, [(4, 0)]),  # the sync came before its first token
        ([], 3, [(4, 10)], 0, 10, [(3, 0)]),  # ... after its last: no token has version 4
        ([], 3, [(4, 2), (5, 2)], 0, 10, [(3, 0), (5, 2)]),  # two syncs at one token
        ([], 3, [(4, 0)], 0, 0, [(4, 0)]),  # no token at all: the engine's last version
        ([(3, 0)], 3, [(4, 8)], 5, 10, [(3, 0), (4, 8)]),  # a retry on the same version, then a sync
        ([(3, 0), (4, 2)], 5, [], 5, 10, [(3, 0), (4, 2), (5, 5)]),  # a retry on a newer version
    ],
)
def test_weight_spans(prior, start, marks, kept, total, spans):
    assert weight_spans(prior, record(start, marks, kept), total) == spans


def test_weight_spans_survive_the_wire():
    trajectory = Trajectory(
        request_id="r", prompt_token_ids=[1], finish_reason="stop", weight_versions=[(1, 0), (2, 5)]
    )
    assert decode(encode(trajectory)).weight_versions == [(1, 0), (2, 5)]


def test_the_checkpoint_root_is_a_fence(tmp_path: Path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    for folder in (root / "step-1", outside):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"{}")
    assert checkpoint_dir(root, str(root / "step-1")) == (root / "step-1").resolve()
    (root / "link").symlink_to(outside)
    (root / "step-2").mkdir()
    (root / "step-2" / "model.safetensors").symlink_to(outside / "model.safetensors")
    for path, why in [
        (outside, "outside"),
        (root / "link", "outside"),  # a symlink out of the root
        (root / "step-2", "outside"),  # a weights file linked from outside
        (root / "step-1" / ".." / ".." / "outside", "outside"),
        (root / "missing", "no model.safetensors"),
    ]:
        with pytest.raises(InvalidRequestError, match=why):
            checkpoint_dir(root, str(path))
    with pytest.raises(InvalidRequestError, match="ROLLOUT_CHECKPOINT_ROOT"):
        checkpoint_dir(None, str(root / "step-1"))


def _index(folder: Path, weight_map: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_sharded_checkpoint_is_its_index_and_every_shard_it_names_inside_the_root(tmp_path: Path):
    """Hugging Face's sharded layout (prime-rl's trainer writes it): the shards the index names, sorted; a shard
    missing, linked from outside the root, or named outside the folder is refused, as a bad index is."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "b.safetensors").write_bytes(b"b")
    good = root / "step-1"
    _index(good, {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    for name in ("a.safetensors", "b.safetensors"):
        (good / name).write_bytes(name.encode())
    assert checkpoint_dir(root, str(good)) == good.resolve()
    assert [f.name for f in checkpoint_files(good)] == ["a.safetensors", "b.safetensors"]
    _index(root / "linked", {"x": "b.safetensors"})
    (root / "linked" / "b.safetensors").symlink_to(outside / "b.safetensors")
    _index(root / "short", {"x": "a.safetensors", "y": "b.safetensors"})
    (root / "short" / "a.safetensors").write_bytes(b"a")
    _index(root / "climbs", {"x": "../step-1/a.safetensors"})
    _index(root / "bad", ["a.safetensors"])
    for folder, why in [
        ("linked", "outside"),
        ("short", "lacks b.safetensors"),
        ("climbs", "outside its folder"),
        ("bad", "not a safetensors shard index"),
    ]:
        with pytest.raises(InvalidRequestError, match=why):
            checkpoint_dir(root, str(root / folder))


async def test_a_load_waits_for_the_stable_marker_and_refuses_a_folder_without_it(tmp_path: Path):
    with pytest.raises(InvalidRequestError, match=r"no STABLE marker after 0\.3 s"):
        await await_stable(str(tmp_path), 0.3)
    asyncio.get_running_loop().call_later(0.3, (tmp_path / "STABLE").touch)
    started = time.monotonic()
    await await_stable(str(tmp_path), 5.0)
    assert 0.25 < time.monotonic() - started < 4.0
