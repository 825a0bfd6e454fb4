# Redis from a Debian-based image (Debian bookworm's redis-server is 7.0), for hosts that cannot pull redis:7.2-alpine:
# `docker build -f docker/redis.Dockerfile --build-arg BASE=rollout-svc-base:bookworm -t rollout-svc-redis .`, then
# ROLLOUT_REDIS_IMAGE=rollout-svc-redis for docker-compose.yml. Same command line and data folder as the official image.
ARG BASE=python:3.11-slim
FROM ${BASE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
