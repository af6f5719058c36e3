"""``promtool test rules``: the alert thresholds and ``for:`` durations of rules.yaml, unit-tested.

The cases live in ``deploy/prometheus/rules_test.yaml``; a copy of the rules with one
threshold or one duration moved must fail them, so the cases really pin the numbers.
promtool comes from Debian's ``prometheus`` package (``.ci/run``); missing: a failure under
CI, a skip elsewhere.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.prom_live import ROOT, binary

RULES_DIR = ROOT / "deploy" / "prometheus"


def promtool_test(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), "test", "rules", "rules_test.yaml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=directory,
    )


def test_alert_thresholds_pass_their_unit_tests() -> None:
    result = promtool_test(RULES_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("> 0.05", "> 0.06"),  # shed-rate threshold
        ("> 0.1\n", "> 0.2\n"),  # Redis fallback rate
        ("== 0\n        for: 1m", "== 0\n        for: 3m"),  # no healthy endpoints: duration
        (
            "llm_gateway_endpoint_ejected) == 1\n        for: 5m",
            "llm_gateway_endpoint_ejected) == 1\n        for: 1m",
        ),
    ],
)
def test_a_moved_threshold_fails_them(tmp_path: Path, old: str, new: str) -> None:
    text = (RULES_DIR / "rules.yaml").read_text()
    assert text.count(old) == 1, old
    (tmp_path / "rules.yaml").write_text(text.replace(old, new))
    shutil.copy(RULES_DIR / "rules_test.yaml", tmp_path / "rules_test.yaml")
    result = promtool_test(tmp_path)
    assert result.returncode != 0, result.stdout
