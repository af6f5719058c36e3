"""`python -m loadtest.simulator --port 8001 ...`"""

from __future__ import annotations

import argparse
import sys

from .cli import add_sim_arguments, run_sim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.simulator", description="Simulated vLLM/SGLang replica"
    )
    add_sim_arguments(parser)
    return run_sim(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
