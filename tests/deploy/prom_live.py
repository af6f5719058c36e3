"""A real Prometheus server for tests: fast intervals, temp storage, loopback port, HTTP API client.

``fast_rules`` derives a test copy of ``deploy/prometheus/rules.yaml`` in which only time
constants shrink (evaluation interval, range windows, ``for:`` durations — each mapped by
the tables below); every expression, threshold, label and annotation is the real file's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from loadtest.harness.ports import free_port

__all__ = [
    "FOR_SCALE",
    "WINDOW_SCALE",
    "Prometheus",
    "binary",
    "dashboard_queries",
    "fast_rules",
    "running_prometheus",
]

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))

#: ``for:`` in the real rules → in the test copy.
FOR_SCALE = {"1m": "2s", "5m": "3s", "10m": "4s"}
#: Range windows (``[5m]``) in the real rules → in the test copy.
WINDOW_SCALE = {"5m": "10s", "10m": "20s"}
#: Grafana's built-in interval variables, for a 1 s scrape interval (4 × scrape, Grafana's rule).
GRAFANA_VARS = {"__rate_interval": "10s", "__interval": "1s", "__range": "5m"}


def binary(name: str) -> str:
    """``prometheus`` / ``promtool``: a failure under CI, a loud skip elsewhere (as in test_promtool)."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is missing under CI: .ci/run must install Debian's prometheus package")
        pytest.skip(f"{name} not installed (apt-get install --no-install-recommends prometheus)")
    return path


def _scale_windows(expr: str) -> str:
    def repl(match: re.Match[str]) -> str:
        window = match.group(1)
        if window not in WINDOW_SCALE:
            raise ValueError(f"no test window for [{window}] in {expr!r}: extend WINDOW_SCALE")
        return f"[{WINDOW_SCALE[window]}]"

    return re.sub(r"\[(\d+[smhd])\]", repl, expr)


def fast_rules(source: Path = RULES) -> dict[str, Any]:
    doc = yaml.safe_load(source.read_text())
    for group in doc["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            rule["expr"] = _scale_windows(rule["expr"])
            if "for" in rule:
                if rule["for"] not in FOR_SCALE:
                    raise ValueError(f"no test duration for for: {rule['for']}: extend FOR_SCALE")
                rule["for"] = FOR_SCALE[rule["for"]]
    return doc


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr with Grafana variables substituted) for every target."""
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        variables = {v["name"]: ".+" for v in dashboard.get("templating", {}).get("list", [])}
        panels = list(dashboard["panels"])
        for panel in list(panels):
            panels.extend(panel.get("panels", []))
        for panel in panels:
            for target in panel.get("targets", []):
                if "expr" in target:
                    out.append((path.name, panel.get("title", "?"), _substitute(target["expr"], variables)))
    return out


def _substitute(expr: str, variables: dict[str, str]) -> str:
    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in GRAFANA_VARS:
            return GRAFANA_VARS[name]
        if name in variables:  # a template variable ($model): any value
            return variables[name]
        raise ValueError(f"unknown Grafana variable ${name} in {expr!r}")

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    session: aiohttp.ClientSession
    log_path: Path

    async def api(self, path: str, **params: str) -> Any:
        async with self.session.get(self.url + path, params=params) as resp:
            body = await resp.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self.api("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    async def alerts(self, state: str = "firing") -> list[dict[str, Any]]:
        return [a for a in (await self.api("/api/v1/alerts"))["alerts"] if a["state"] == state]

    async def rules(self) -> list[dict[str, Any]]:
        return [r for g in (await self.api("/api/v1/rules"))["groups"] for r in g["rules"]]

    async def targets_up(self) -> int:
        return sum(1 for t in (await self.api("/api/v1/targets"))["activeTargets"] if t["health"] == "up")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log_file:
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@contextlib.asynccontextmanager
async def running_prometheus(
    targets: list[str], tmp: Path, rules: dict[str, Any]
) -> AsyncIterator[Prometheus]:
    """Prometheus scraping ``targets`` (host:port) every second, evaluating ``rules`` every second."""
    exe = binary("prometheus")
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(tmp / "rules.yaml")],
        "scrape_configs": [{"job_name": "llm-gateway", "static_configs": [{"targets": targets}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = tmp / "prometheus.log"
    argv = [
        exe,
        f"--config.file={tmp / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
        "--log.level=warn",
    ]
    proc = _spawn(argv, log_path)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, session, log_path)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{prom.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(prom.url + "/-/ready") as resp:
                    if resp.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready after 30 s:\n{prom.log_tail()}")
            await asyncio.sleep(0.2)
        yield prom
    finally:
        await session.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 10)
            except TimeoutError:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
