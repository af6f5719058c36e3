"""The alert and recording rules pass Prometheus's own checker, ``promtool check rules``.

promtool comes from Debian's ``prometheus`` package; ``.ci/run`` installs it. Under CI a
missing promtool is a failure; on a developer machine without it the test is skipped
(the rules are still parsed and their metric names checked in test_deploy.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yaml"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing under CI: .ci/run must install Debian's prometheus package")
        pytest.skip("promtool not installed (apt-get install --no-install-recommends prometheus)")
    return path


def test_rules_pass_promtool() -> None:
    result = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "groups:\n- name: g\n  rules:\n  - alert: Broken\n    expr: sum(rate(llm_gateway_requests_total[5m]\n"
    )
    result = subprocess.run(
        [_promtool(), "check", "rules", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
