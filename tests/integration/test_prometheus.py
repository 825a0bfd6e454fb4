"""docs/metrics.md's queries behind each dashboard panel, run against a real Prometheus (Debian's package, as the
compose `monitoring` profile runs it) scraping `serve` and 2 echo workers' metrics servers under load: each answers
with data. The `vllm:` queries need a GPU worker (vLLM logs no stats on the CPU) and are left out here."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from rollout_svc.deploy.processes import free_port
from tests.support import ROOT, serve, wait_until

pytestmark = pytest.mark.timeout(180)
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def panel_queries() -> dict[str, str]:
    """{panel: query} of the table under "Prometheus for the whole fleet" in docs/metrics.md."""
    text = (ROOT / "docs" / "metrics.md").read_text().split("## Prometheus for the whole fleet", 1)[1]
    return {m[1]: m[2] for m in re.finditer(r"^\| ([^|`]+?) \| `(.+)` \|$", text, re.M)}


def start_prometheus(url: str, targets: dict[str, list[str]], tmp_path: Path) -> subprocess.Popen[bytes]:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": t}]} for job, t in targets.items()],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    args = [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
    args += [f"--web.listen-address={url.removeprefix('http://')}"]
    with open(tmp_path / "prometheus.log", "wb") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def test_each_panel_query_answers_from_a_real_prometheus(settings, echo_workers, tmp_path):
    queries = {panel: query for panel, query in panel_queries().items() if "vllm:" not in query}
    assert len(queries) >= 12, queries
    ports = [free_port(), free_port()]
    for port in ports:
        echo_workers(1, "--metrics-port", str(port), "--echo-token-delay-s", "0.002")
    assert Path(PROMETHEUS).exists(), f"no Prometheus at {PROMETHEUS}: `make install` installs Debian's (as root)"
    url = f"http://127.0.0.1:{free_port()}"
    with serve(settings, tmp_path / "serve.log") as base:
        targets = {"serve": [base.removeprefix("http://")], "workers": [f"127.0.0.1:{p}" for p in ports]}
        proc = start_prometheus(url, targets, tmp_path)
        try:
            deadline = time.monotonic() + 12  # traffic, plain and streamed through the API, over a dozen scrapes
            with httpx.Client(base_url=base, timeout=30) as http:
                while time.monotonic() < deadline:
                    body = {"model": "echo", "prompt": [1, 2, 3, 4], "max_tokens": 8}
                    http.post("/v1/completions", json=body | {"n": 4}).raise_for_status()
                    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as streamed:
                        assert streamed.status_code == 200 and "[DONE]" in streamed.read().decode()
            answers = {}
            for panel, query in queries.items():

                def answered(query: str = query) -> list:
                    reply = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5).json()
                    assert reply["status"] == "success", reply
                    return reply["data"]["result"]

                answers[panel] = wait_until(answered, 20, f"data for {panel!r}: {query}")
        finally:
            proc.terminate()
            proc.wait(10)
    up = {series["metric"]["instance"] for series in answers["workers up (one series a worker)"]}
    assert up == {f"127.0.0.1:{p}" for p in ports}  # a series of every worker
    in_flight = answers["the step's timeline: requests in flight per worker"]
    assert len({series["metric"]["instance"] for series in in_flight}) == 2
    assert float(answers["requests a second"][0]["value"][1]) > 0
