"""Per-request costs of the workers' shared fleet view (issue 17 item 3), by ``timeit``.

    python -m loadtest.worker_share_cost

Prints, best of 5: one hook write to the shared load cells; the refresh that sums the rows
back into the endpoints (4 and 64 endpoints: no row changed since the last refresh, one,
every one; the writes' own cost taken out) and the refresh skipped within its millisecond;
encoding, decoding and applying one prefix record of 128 blocks (an 8 KB prompt); and the
CPU of sending such records one per datagram between two real buses (no batching: the worst
case); and a session pin sent to a sibling and applied there. Everything lives in a temporary
directory; nothing is listened on but unix sockets.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import timeit

from gateway.fleet.endpoint import Endpoint
from gateway.fleet.registry import EndpointRegistry
from gateway.fleet.shared_load import SharedLoad
from gateway.fleet.worker_table import WorkerTable, create_table
from gateway.prefix.broadcast import PrefixBus, _decode, _encode
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.sessions.placement import SessionPlacement
from gateway.sessions.session_broadcast import BroadcastSessionStore
from gateway.sessions.store import MemorySessionStore

__all__ = ["main"]

NAME = "10.0.0.1:8000"
HASHES = list(range(10**12, 10**12 + 128))  # an 8 KB prompt: 128 blocks of 64 bytes


def _best_us(stmt: str, number: int, **names: object) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=5, globals=names)) / number * 1e6


def _load(directory: str) -> None:
    for fleet in (4, 64):
        sub = os.path.join(directory, f"fleet-{fleet}")
        os.mkdir(sub)
        urls = [f"http://10.0.0.{i}:8000" for i in range(fleet)]
        registry = EndpointRegistry(Endpoint(url, configured_models=frozenset({"m"})) for url in urls)
        shared = SharedLoad(WorkerTable(create_table(sub, 1024, 2), 0), registry)
        shared.refresh(force=True)
        cells = [endpoint.shared_load for endpoint in registry]
        cell = cells[0]
        write = _best_us("cell.add(1, 100)", 200000, cell=cell)
        unchanged = _best_us("shared.refresh(force=True)", 20000, shared=shared)
        one = _best_us("cell.add(1, 100); shared.refresh(force=True)", 5000, shared=shared, cell=cell)
        spread = cells[:: max(1, fleet // 8)][:8]  # up to 8 rows, spread over the table
        eight = _best_us(
            "for c in cells: c.add(1, 100)\nshared.refresh(force=True)", 2000, shared=shared, cells=spread
        )
        every = _best_us(
            "for c in cells: c.add(1, 100)\nshared.refresh(force=True)", 1000, shared=shared, cells=cells
        )
        skipped = _best_us("shared.refresh()", 20000, shared=shared)
        print(
            f"{fleet} endpoints: refresh with no row changed {unchanged:.2f} us, one row changed"
            f" {one - write:.2f} us, {len(spread)} rows {eight - len(spread) * write:.2f} us,"
            f" every row {every - fleet * write:.2f} us;"
            f" skipped {skipped:.3f} us; write {write:.3f} us"
        )


def _records() -> None:
    encode = _best_us("_encode([(name, hashes)])", 5000, _encode=_encode, name=NAME, hashes=HASHES)
    datagram = _encode([(NAME, HASHES)])[0]
    decode = _best_us("_decode(datagram)", 5000, _decode=_decode, datagram=datagram)
    index = MemoryPrefixIndex()
    apply = _best_us("index.record(hashes, name)", 5000, index=index, hashes=HASHES, name=NAME)
    print(f"128-block record: encode {encode:.2f} us, decode {decode:.2f} us, apply {apply:.2f} us")


async def _sends(directory: str, count: int = 2000) -> None:
    sub = os.path.join(directory, "bus")
    os.mkdir(sub)
    sender, receiver = PrefixBus(sub, 0, 2), PrefixBus(sub, 1, 2)
    received: list[int] = []
    receiver.listen(lambda _endpoint, _hashes: received.append(1))
    started = time.process_time()
    for _ in range(count):
        sender.publish(NAME, HASHES)
        await asyncio.sleep(0)  # one record per loop turn: one datagram each
    for _ in range(5000):
        if len(received) >= count:
            break
        await asyncio.sleep(0.001)
    cpu_us = (time.process_time() - started) / count * 1e6
    print(f"publish + send + receive + apply, one record per datagram: {cpu_us:.1f} us CPU per record")
    sender.close()
    receiver.close()


async def _pins(directory: str, count: int = 5000) -> None:
    """A session pin sent to a sibling and applied there (its store and its placement)."""
    sub = os.path.join(directory, "sessions")
    os.mkdir(sub)
    placement = SessionPlacement(600, 100_000)
    sender, receiver = (
        BroadcastSessionStore(MemorySessionStore(600, 100_000), SessionPlacement(600, 100_000), sub, 0, 2),
        BroadcastSessionStore(MemorySessionStore(600, 100_000), placement, sub, 1, 2),
    )
    receiver.start()
    sessions = [f"{i:032x}" for i in range(count)]  # session keys as the parser makes them
    started = time.process_time()
    for session in sessions:
        sender.pin(session, NAME)
        await asyncio.sleep(0)
    for _ in range(5000):
        if receiver.local.get_now(sessions[-1]) is not None:
            break
        await asyncio.sleep(0.001)
    cpu_us = (time.process_time() - started) / count * 1e6
    print(f"session pin: pin + send + receive + apply (store and placement): {cpu_us:.1f} us CPU per pin")
    await sender.close()
    await receiver.close()


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        _load(directory)
        _records()
        asyncio.run(_sends(directory))
        asyncio.run(_pins(directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
