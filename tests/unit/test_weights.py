"""Weight sync's pure parts: bucket packing, version spans, the checkpoint root, the wire messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout_svc.dataplane.streams import Entry
from rollout_svc.errors import InvalidRequestError, ProtocolError
from rollout_svc.protocol import (
    Continuation,
    RolloutRequest,
    SamplingParams,
    Trajectory,
    WeightManifest,
    decode,
    encode,
)
from rollout_svc.weightsync.plane import checkpoint_dir
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
