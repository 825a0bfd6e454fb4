# Prometheus from Debian's package (bookworm: 2.42), on the same base as the other images (docker/build-base.sh where
# no registry is reachable), scraping `serve` and every worker: docker-compose.yml's `monitoring` profile. Build
# context: docker/. The configuration is docker/prometheus.yml; the data lives in the container (a restart keeps it,
# `compose down -v` removes it).
ARG BASE=python:3.11-slim
FROM ${BASE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
COPY prometheus.yml /etc/prometheus/prometheus.yml
USER prometheus
EXPOSE 9090
CMD ["prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.listen-address=:9090"]
