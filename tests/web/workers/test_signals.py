"""Signals with `serve --workers 2`: a process-group SIGTERM (systemd's default KillMode,
Ctrl-C in a terminal) must drain like a SIGTERM to the parent does; a SIGHUP during startup
must not kill workers."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import aiohttp

from loadtest.harness.processes import wait_ready
from tests.support.workers import alive, by_worker, children, handles_signal, spawn_gateway

LONG = {"model": "m", "messages": [{"role": "user", "content": "hold"}], "max_tokens": 400, "stream": True}


async def _read_stream(resp: aiohttp.ClientResponse) -> tuple[bool, str]:
    """(saw [DONE], last data line or error)."""
    last = ""
    try:
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data:"):
                last = line
                if line == "data: [DONE]":
                    return True, last
    except aiohttp.ClientError as exc:
        return False, f"cut: {exc!r}"
    return False, f"ended without [DONE] after {last!r}"


def _killpg(gw, signum: int) -> None:
    os.killpg(gw.pid, signum)  # what systemd (KillMode=control-group) or a terminal's Ctrl-C does


async def _every_process(gw, signum: int) -> None:
    """The same signal to each process of the gateway, workers first (as `kill` of every pid,
    or systemd walking the cgroup, may order it): deterministic, unlike killpg's race."""
    for pid in children(gw.pid):
        os.kill(pid, signum)
    await asyncio.sleep(0.2)
    os.kill(gw.pid, signum)


async def _group_signal_drains(start_sim, tmp_path, signum: int, deliver=None) -> None:
    sim = await start_sim(model="m", time_scale=1.0)
    config = tmp_path / "gw.yaml"
    config.write_text("server:\n  drain_s: 0.3\n  shutdown_timeout_s: 20\n")
    gw = await spawn_gateway(
        [sim.url], ["--workers", "2", "--config", str(config)], tmp_path, new_session=True
    )
    try:
        async with by_worker(gw.url) as found:
            streams = []
            for sessions in found.values():
                resp = await sessions[0].post(gw.url + "/v1/chat/completions", json=LONG)
                assert resp.status == 200
                streams.append(resp)
            await asyncio.sleep(0.3)
            if deliver is None:
                _killpg(gw, signum)
            else:
                await deliver(gw, signum)
            results = await asyncio.gather(*(_read_stream(r) for r in streams))
        await asyncio.wait_for(gw.process.wait(), 30)
        log = gw.log_tail(20000)
        assert all(done for done, _ in results), (results, log)
        assert "second stop signal" not in log, log
    finally:
        await gw.stop()


async def test_process_group_sigterm_drains_open_streams(start_sim, tmp_path):
    await _group_signal_drains(start_sim, tmp_path, signal.SIGTERM)


async def test_process_group_sigint_drains_open_streams(start_sim, tmp_path):
    await _group_signal_drains(start_sim, tmp_path, signal.SIGINT)


async def test_sigterm_to_every_gateway_process_drains_open_streams(start_sim, tmp_path):
    await _group_signal_drains(start_sim, tmp_path, signal.SIGTERM, _every_process)


async def _parent_only(gw, signum: int) -> None:
    os.kill(gw.pid, signum)


async def test_parent_only_sigterm_drains_open_streams(start_sim, tmp_path):
    """The control: SIGTERM to the parent only (what Kubernetes does to PID 1)."""
    await _group_signal_drains(start_sim, tmp_path, signal.SIGTERM, _parent_only)


async def test_sighup_while_workers_start_keeps_them(start_sim, tmp_path):
    """A reload request (SIGHUP, e.g. from config management) right after start must not kill workers."""
    sim = await start_sim(model="m")
    config = tmp_path / "gw.yaml"
    config.write_text("{}\n")
    gw = await spawn_gateway([sim.url], ["--workers", "2", "--config", str(config)], tmp_path, ready=False)
    try:
        for _ in range(600):  # the parent forwards SIGHUP once its handler is in
            if handles_signal(gw.pid, signal.SIGHUP) and len(children(gw.pid)) >= 2:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("parent never installed its SIGHUP handler")
        workers = children(gw.pid)
        os.kill(gw.pid, signal.SIGHUP)
        await wait_ready(gw, "/ready", 30)  # both workers start up, then a moment to die if they would
        await asyncio.sleep(1)
        # both workers still running and serving
        assert gw.running, gw.log_tail()
        assert all(alive(pid) for pid in workers), (workers, gw.log_tail())
        async with aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/ready") as resp:
                assert resp.status == 200
    finally:
        await gw.stop()


async def test_all_workers_failing_exits_nonzero(tmp_path):
    """Every worker fails to bind (the port is taken): the gateway must not exit 0."""
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    gw = None
    try:
        gw = await spawn_gateway(["http://127.0.0.1:9"], ["--workers", "2"], tmp_path, port=port, ready=False)
        code = await asyncio.wait_for(gw.process.wait(), 60)
        assert code != 0, (code, gw.log_tail())
    finally:
        if gw is not None:  # a gateway that never exited must not outlive the test
            await gw.stop()
        blocker.close()
