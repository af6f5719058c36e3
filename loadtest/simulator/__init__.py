"""Faithful vLLM/SGLang replica simulator: the gateway's test backend and benchmark fleet."""

from __future__ import annotations

from .config import SimConfig
from .server import RunningSimulator, build_app, running_simulator

__all__ = ["RunningSimulator", "SimConfig", "build_app", "running_simulator"]
