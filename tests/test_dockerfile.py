"""The Dockerfile cannot be built here (no Docker engine): check what can be checked.

Every path it copies from the build context exists and is not excluded by .dockerignore,
its entry point is the console script the package declares, and the command it runs
accepts the arguments it passes (the config it ships loads and validates).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions(keyword: str) -> list[str]:
    return [line.split(None, 1)[1] for line in DOCKERFILE.splitlines() if line.startswith(keyword + " ")]


def test_every_copied_path_exists_and_is_not_ignored() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()}
    sources = []
    for args in _instructions("COPY"):
        if args.startswith("--from="):
            continue
        sources.extend(args.split()[:-1])
    assert sources, "no COPY from the build context"
    for source in sources:
        assert (ROOT / source).exists(), source
        assert source.rstrip("/") not in ignored, f"{source} is excluded by .dockerignore"


def test_entrypoint_is_the_declared_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (entrypoint,) = _instructions("ENTRYPOINT")
    assert entrypoint.startswith('["llm-gateway", "serve"]')
    assert scripts["llm-gateway"] == "gateway.cli:main"


def test_the_shipped_config_is_valid_with_the_image_command_line() -> None:
    (cmd,) = _instructions("CMD")
    assert "/etc/llm-gateway/gateway.yaml" in cmd
    check = (
        "from gateway.config import load_config; from gateway.http.app import build_app; "
        "build_app(load_config('deploy/examples/gateway.yaml', environ={}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    for flag in ("--config", "--host", "--port"):
        assert flag in help_text.stdout
