"""Clients that leave mid-stream are ordinary: no ERROR traceback in the gateway's log.

When a client's connection goes away between two writes of a stream (the transport is
closing, the handler not yet cancelled), the next write fails with
``ConnectionResetError``. aiohttp logged each of those at ERROR with a traceback ("Error
handling request"): at the end of every load test, dozens per second, paging whoever
watches the error logs. The gateway now logs them as the client disconnects they are
(INFO, counted in ``llm_gateway_client_disconnects_total``).

Real processes, as a load generator meets the gateway: ``llm-gateway serve`` in front of the
zero-work upstream streaming 8 chunks, 64 keep-alive clients asking for streams back to back,
all leaving at the same instant, mid-answer.
"""

from __future__ import annotations

import asyncio
import json
import sys

from loadtest.harness.fleet import start_gateway
from loadtest.harness.ports import free_port
from loadtest.harness.processes import spawn, wait_ready

CLIENTS = 64
BODY = json.dumps({"model": "zero", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


async def _ask_forever(port: int, served: list[int]) -> None:
    """Streams back to back on one connection until cancelled; then leave at once."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while True:
            writer.write(REQUEST)
            answer = b""
            while not answer.endswith(b"0\r\n\r\n"):
                chunk = await reader.read(65536)
                assert chunk, "the gateway closed the connection"
                answer += chunk
            served.append(1)
    finally:
        writer.transport.abort()  # gone mid-answer, as a load generator's connections at its end


async def test_clients_leaving_mid_stream_log_no_error(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.zero_upstream", "--port", str(port), "--model", "zero"]
    upstream = await spawn("zero", f"http://127.0.0.1:{port}", argv, tmp_path)
    gateway = None
    try:
        await wait_ready(upstream, "/health", 20)
        gateway = await start_gateway([upstream.url], ["--policy", "round-robin"], log_dir=tmp_path)
        gw_port = int(gateway.url.rsplit(":", 1)[1])
        for _ in range(3):  # three rounds of everyone leaving at once
            served: list[int] = []
            clients = [asyncio.create_task(_ask_forever(gw_port, served)) for _ in range(CLIENTS)]
            await asyncio.sleep(1.0)
            for client in clients:
                client.cancel()
            outcomes = await asyncio.gather(*clients, return_exceptions=True)
            assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes[:3]
            assert len(served) > CLIENTS  # the streams flowed before everyone left
        await asyncio.sleep(0.5)
        log = gateway.log_tail(1_000_000)
        assert "client disconnected" in log  # the case happened, and was logged as what it is
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    finally:
        if gateway is not None:
            await gateway.stop()
        await upstream.stop()
