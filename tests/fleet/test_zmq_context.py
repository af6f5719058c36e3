"""A ZeroMQ context collected together with an open socket must not hang the process.

Each case runs in a child process (a hang would otherwise stop this test run, as it once
stopped a whole CI run inside an unrelated call that triggered a collection): a context
and a connected socket in a reference cycle are dropped and collected. pyzmq's own context
never returns (the control: it shows the case is real and the check able to fail); the
gateway's :class:`OwnedContext` returns at once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import asyncio, gc, sys
    import zmq, zmq.asyncio
    from gateway.fleet.zmq_context import OwnedContext

    async def main():
        ctx = OwnedContext() if sys.argv[1] == "owned" else zmq.asyncio.Context()
        class Holder:
            pass
        holder = Holder()
        holder.ctx, holder.sock, holder.me = ctx, ctx.socket(zmq.SUB), holder
        holder.sock.connect("tcp://127.0.0.1:9")
        del holder, ctx
        gc.collect()
        print("collected", flush=True)

    asyncio.run(main())
    """
)


def _collect(kind: str, timeout_s: float) -> str | None:
    """The child's output, or None if it was still blocked after ``timeout_s``."""
    try:
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _CHILD, kind],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return None
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_owned_context_is_collected_with_its_open_socket() -> None:
    assert _collect("owned", timeout_s=30) == "collected\n"


def test_pyzmq_context_collected_with_an_open_socket_hangs() -> None:
    assert _collect("plain", timeout_s=3) is None
