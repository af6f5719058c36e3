"""Garbage on the sibling sockets (a local process of the same user) and a stopped/dead sibling."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import struct
import time

from tests.support.workers import by_worker, children, shared_directory, spawn_gateway

KEY = "workers-admin-key"
ADMIN = {"authorization": f"Bearer {KEY}"}
SHORT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _send(path: str, datagram: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(datagram, path)


async def test_garbage_on_sibling_sockets_leaves_workers_serving_and_sharing(start_sim, tmp_path):
    sims = [await start_sim(model="m") for _ in range(2)]
    extra = await start_sim(model="m")
    config = tmp_path / "gw.yaml"
    config.write_text(f"auth:\n  admin_key_sha256: {hashlib.sha256(KEY.encode()).hexdigest()}\n")
    gw = await spawn_gateway([s.url for s in sims], ["--workers", "2", "--config", str(config)], tmp_path)
    try:
        async with by_worker(gw.url) as found:
            pids = [int(p) for p in found]
            directory = shared_directory(pids[0])
            garbage = [
                b"",
                b"\x01",
                b"\xff" * 6,
                struct.pack("<HI", 5, 0xFFFFFFFF) + b"abcde",
                struct.pack("<HI", 3, 1) + b"\xff\xfe\xfd" + b"\x00" * 8,
                struct.pack("<HI", 0xFFFF, 0) + b"x" * 10,
                os.urandom(60_000),
                b"[" * 100_000 + b"]" * 100_000,  # deep JSON: RecursionError in json.loads
                b'{"endpoints": [{"url": "http://127.0.0.1:1"}], "draining": 5}',
                b'{"endpoints": {"a": 1}, "draining": []}',
                b'{"endpoints": [1, 2], "draining": []}',
                b"null",
                b'"str"',
                b"\xff\xfe",
            ]
            for w in range(2):
                for kind in ("prefix", "admin", "responses", "sessions"):
                    path = os.path.join(directory, f"{kind}-{w}.sock")
                    if not os.path.exists(path):
                        continue
                    for g in garbage:
                        try:
                            _send(path, g)
                        except OSError:
                            pass
                        await asyncio.sleep(0.005)
            await asyncio.sleep(0.5)
            assert all(p in children(gw.pid) for p in pids), gw.log_tail()
            for sessions in found.values():
                for _ in range(3):
                    async with sessions[0].post(gw.url + "/v1/chat/completions", json=SHORT) as resp:
                        assert resp.status == 200, await resp.text()
            # admin replay still works after the garbage
            first, second = (sessions[0] for sessions in found.values())
            async with first.post(
                gw.url + "/admin/endpoints", json={"url": extra.url}, headers=ADMIN
            ) as resp:
                assert resp.status == 201, await resp.text()
            for _ in range(30):
                async with second.get(gw.url + "/admin/endpoints", headers=ADMIN) as resp:
                    urls = {r["url"] for r in (await resp.json())["endpoints"]}
                if extra.url in urls:
                    break
                await asyncio.sleep(0.1)
            assert extra.url in urls, gw.log_tail()
    finally:
        await gw.stop()


async def test_a_deeply_nested_admin_datagram_is_rejected_like_other_garbage(start_sim, tmp_path):
    """_receive catches ValueError/KeyError/TypeError/ConfigError only: json.loads' RecursionError
    escapes into the event loop's exception handler ('Exception in callback', a traceback)."""
    sim = await start_sim(model="m")
    gw = await spawn_gateway([sim.url], ["--workers", "2"], tmp_path)
    try:
        async with by_worker(gw.url) as found:
            directory = shared_directory(int(next(iter(found))))
            _send(os.path.join(directory, "admin-0.sock"), b"[" * 100_000 + b"]" * 100_000)
            await asyncio.sleep(0.5)
            log = gw.log_tail(200_000)
            assert "Exception in callback" not in log, log[-3000:]
    finally:
        await gw.stop()


async def test_metrics_answers_while_a_sibling_is_stopped_or_dead(start_sim, tmp_path):
    sim = await start_sim(model="m")
    gw = await spawn_gateway([sim.url], ["--workers", "3"], tmp_path)
    try:
        async with by_worker(gw.url, workers=3) as found:
            pids = list(found)
            os.kill(int(pids[1]), signal.SIGSTOP)
            os.kill(int(pids[2]), signal.SIGKILL)
            try:
                started = time.monotonic()
                async with found[pids[0]][0].get(gw.url + "/metrics") as resp:
                    text = await resp.text()
                    assert resp.status == 200
                took = time.monotonic() - started
                assert took < 3, took
                assert 'worker="0"' in text or 'worker="1"' in text or 'worker="2"' in text
                async with found[pids[0]][0].post(gw.url + "/v1/chat/completions", json=SHORT) as resp:
                    assert resp.status == 200
            finally:
                os.kill(int(pids[1]), signal.SIGCONT)
    finally:
        await gw.stop()
