"""The GPU check a lent device runs (`rollout_svc.tools.gpu_check`): the trainer's side of a weight sync, sent over
gloo to a receiver in another process, bytes equal at both ends; its CPU path here, its GPU path marked `gpu`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_svc.tools.bench.gpu import render_gpu
from rollout_svc.tools.gpu_check import SMALL, ModelShape, main, run_check


@pytest.mark.timeout(120)
def test_the_check_sends_a_state_dict_to_a_receiver_process_and_both_ends_digest_the_same_bytes(tmp_path: Path):
    assert main(["--small", "--device", "cpu", "--out", str(tmp_path / "gpu.json")]) == 0
    figures = json.loads((tmp_path / "gpu.json").read_text())
    expected = sum(2 * n for _, dims in SMALL.shapes() for n in [_numel(dims)])  # bf16: 2 bytes each
    assert figures["digests_equal"] is True and figures["tensors"] == len(SMALL.shapes()) == 1 + 2 * 12 + 2
    assert expected <= figures["bytes"] <= expected + 64 * figures["tensors"]  # aligned offsets add < 64 B each
    assert figures["send_s"] > 0 and figures["receive_s"] > 0


def test_the_seven_b_shape_is_qwen2_5_7b():
    params = sum(_numel(dims) for _, dims in ModelShape().shapes())
    assert 7.6e9 < params < 7.7e9  # Qwen2.5-7B-Instruct: 7.62 B with its untied lm_head


def test_the_report_says_plainly_when_there_was_no_gpu():
    text = render_gpu(None, "rollout-svc bench --only gpu")
    assert "## (n) GPU" in text and "No GPU on" in text and "no CUDA device" in text


@pytest.mark.gpu
def test_on_a_gpu_the_7b_state_dict_reaches_the_cpu_receiver_intact():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the state dict is held on it, as a trainer holds its model")
    figures = run_check(ModelShape(layers=4), "cuda")
    assert figures.digests_equal and figures.device != "cpu"
    assert figures.pack_over_bare < 3  # packing costs about one copy off the GPU, not several


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n
