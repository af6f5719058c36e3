"""The parent of ``serve --workers N``: starts the worker processes, forwards signals to them,
clears a dead worker's shared cells, and starts it again.

Why restart: a worker killed (the OOM killer, ``kill -9``) or crashed would otherwise leave the
gateway on fewer cores for good. A replacement starts in the same slot (at once, then slower
while it keeps dying: :class:`Backoff`) with the config its siblings run — each worker writes
what it runs to the shared directory when the gateway starts and after every reload it applies
(:func:`publish_config`), so a replacement runs neither the start config nor a file its
siblings refused — and applies the newest admin state (``AdminShare.catch_up``).

Signals: the parent forwards SIGTERM, SIGINT and SIGHUP to each worker that is listening (it
writes one byte on a pipe once it does). A worker still starting serves nothing: a stop ends it
at once (it may hang, and a stop must not wait for it), and its exit is not a failure; a reload
reaches it once it listens (sent at once, SIGHUP would kill it half-started).

Hangs: a worker whose event loop stops running (a blocking call, a deadlock, SIGSTOP) does not
exit, and the kernel still hands it its share of new connections (SO_REUSEPORT). Each worker's
loop beats in the shared table; one silent for ``server.worker_timeout_s`` is SIGKILLed, and
then replaced like any dead worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfig
from gateway.fleet.worker_table import WorkerTable
from gateway.http.workers import STATUS_FILE, WorkerSlot
from gateway.ops.catch_up import remove_files_of
from gateway.ops.shared_files import newest, write_whole

__all__ = ["RESPAWN_DELAYS_S", "STABLE_S", "Backoff", "publish_config", "published_config", "supervise"]

log = logging.getLogger(__name__)

RESPAWN_DELAYS_S = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # by the deaths since it last ran stably
STABLE_S = 60.0  # a worker that ran this long before it died starts the delays over
_WAIT_SLICE_S = 0.2  # the parent looks at its stop flag at least this often while a respawn waits
_CONFIG_FILE = "config-{}.pickle"

# (the worker's entry point): config, log level, reload source, slot, parent pid, "started" pipe
WorkerMain = Callable[[GatewayConfig, str, Any, WorkerSlot, int, Connection | None], None]


@dataclass
class _Worker:
    """One worker process: its slot, whether it listens yet, the signals it gets once it does."""

    slot: WorkerSlot
    process: multiprocessing.process.BaseProcess
    started: Connection  # the worker writes one byte here once its listener is up
    born: float
    listening: bool = False
    listened_at: float = 0.0  # when the parent read its byte: the hang clock starts there at the latest
    killed: bool = False  # SIGKILLed as hung: its exit is on its way
    silent: bool = False  # its pipe closed without the byte: it died before it listened
    pending: list[int] = field(default_factory=list)

    def read_started(self) -> bool:
        """Whether it wrote its byte (poll() is also true at EOF: a worker that died first)."""
        if not self.listening and not self.silent:
            try:
                self.listening = self.started.poll() and self.started.recv_bytes() == b"1"
            except (OSError, EOFError):
                self.silent = True
        return self.listening

    def signal(self, signum: int) -> None:
        """Forward ``signum``. A worker still starting serves nothing: a stop ends it at once
        (SIGKILL: it may hang or be stopped, and it has nothing to drain); a reload waits
        until it listens (its loop's handler is not in before)."""
        if self.process.pid is None or not self.process.is_alive():
            return
        if self.listening:
            os.kill(self.process.pid, signum)
        elif signum != signal.SIGHUP:
            os.kill(self.process.pid, signal.SIGKILL)
        elif signum not in self.pending:
            self.pending.append(signum)

    def kill(self) -> None:
        """SIGKILL, which also ends a stopped process; its exit is then reaped as any other's."""
        if self.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
        self.killed = True


@dataclass
class Backoff:
    """How long to wait before starting a slot's worker again: longer with each death, back to
    zero once a worker has run ``STABLE_S`` (a crash loop stays at the longest delay)."""

    deaths: dict[int, int] = field(default_factory=dict)

    def delay_after_exit(self, index: int, ran_s: float) -> float:
        level = 0 if ran_s >= STABLE_S else self.deaths.get(index, 0)
        self.deaths[index] = level + 1
        return RESPAWN_DELAYS_S[min(level, len(RESPAWN_DELAYS_S) - 1)]


def _write_status(
    directory: str, configured: int, listening: int, respawns: list[int], hangs: list[int]
) -> None:
    """What the parent knows and no worker can tell of itself (a slot whose replacement keeps
    dying has no worker to export it): read by every worker at scrape time (``WorkersStatus``)."""
    status = {"configured": configured, "listening": listening, "respawns": respawns, "hangs": hangs}
    write_whole(Path(directory) / STATUS_FILE, json.dumps(status).encode())


def publish_config(directory: str, index: int, config: GatewayConfig, digest: bytes | None) -> None:
    """What this worker runs, for a replacement of any worker (written whole, then renamed;
    pickled as ``spawn`` passes it; the directory is the gateway's own, 0700)."""
    write_whole(Path(directory) / _CONFIG_FILE.format(index), pickle.dumps((config, digest)))


def published_config(directory: str) -> tuple[GatewayConfig, bytes | None] | None:
    """The config the workers run (the newest any worker wrote), with the digest of the file
    it came from; None when there is none or it cannot be read."""
    try:
        path = newest(Path(directory).glob(_CONFIG_FILE.format("*")))
        if path is None:
            return None
        config, digest = pickle.loads(path.read_bytes())
    except Exception as exc:  # a file gone or torn: the replacement starts with the start config
        log.error("the workers' config could not be read; a replacement gets the start config: %s", exc)
        return None
    if not isinstance(config, GatewayConfig) or not isinstance(digest, bytes | None):
        return None
    return config, digest


def supervise(config: GatewayConfig, reload: Any, slots: list[WorkerSlot], worker_main: WorkerMain) -> int:
    """Run the workers until a stop signal; the exit status: 0 when every worker ended cleanly at
    the stop (one that died earlier and was started again does not count), else 1.

    A worker that exits on its own before it first listened (a taken port, a bad config: exit
    status 1) is not started again, it would fail the same way; when every worker has, the
    gateway exits 1. A replacement that fails that way is retried (a Secret being rotated).
    """
    context = multiprocessing.get_context("spawn")
    parent = os.getpid()
    stopping = False
    running: dict[Any, _Worker] = {}  # by sentinel
    due: dict[int, tuple[float, WorkerSlot]] = {}  # slot index -> (when, slot) of a respawn to come
    backoff = Backoff()
    directory = slots[0].directory
    respawns = [0] * len(slots)
    hangs = [0] * len(slots)  # workers killed because their loop stopped beating
    timeout_s = config.server.worker_timeout_s
    check_s = min(1.0, timeout_s / 4)
    last_round = time.monotonic()  # the parent's own last look at the heartbeats

    def status() -> None:
        listening = sum(w.listening for w in running.values())
        try:
            _write_status(directory, len(slots), listening, respawns, hangs)
        except OSError as exc:  # the directory is ours; a full /dev/shm: the metrics go stale
            log.error("worker status not written: %s", exc)

    def start(slot: WorkerSlot, worker_config: GatewayConfig, worker_reload: Any) -> _Worker:
        started, tell_started = context.Pipe(duplex=False)
        process = context.Process(
            target=worker_main,
            args=(worker_config, worker_config.log_level, worker_reload, slot, parent, tell_started),
            name=f"gateway-worker-{slot.index}",
        )
        # A spawned worker keeps an ignored SIGHUP, not a handled one (exec resets it to the
        # default: terminate): ignored while it starts, a hangup sent to the whole process group
        # cannot kill a replacement half-started (the file watch still sees a change sent now).
        handler = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            process.start()
        finally:
            signal.signal(signal.SIGHUP, handler)
        tell_started.close()  # the worker's end
        worker = running[process.sentinel] = _Worker(slot, process, started, time.monotonic())
        return worker

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = stopping or signum != signal.SIGHUP
        for worker in list(running.values()):
            worker.signal(signum)

    for slot in slots:
        start(slot, config, reload)
    status()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    table = WorkerTable(slots[0].table, None)
    failed = False
    try:
        while running or (due and not stopping):
            timeout = None  # no respawn waiting: until a worker starts or exits
            if due and not stopping:
                next_due = min(when for when, _ in due.values())
                timeout = min(_WAIT_SLICE_S, max(0.0, next_due - time.monotonic()))
            if timeout_s > 0 and any(w.listening for w in running.values()):
                timeout = check_s if timeout is None else min(timeout, check_s)
            starting = {w.started: w for w in running.values() if not (w.listening or w.silent)}
            for ready in wait([*running, *starting], timeout=timeout):
                if ready in starting:
                    worker = starting[ready]
                    if worker.read_started():
                        worker.listened_at = time.monotonic()
                        for signum in worker.pending:  # what came while it started
                            worker.signal(signum)
                        worker.pending.clear()
                        status()
                    continue
                worker = running.pop(ready)
                failed = _reap(worker, table, stopping, due, backoff) or failed
                status()
            if timeout_s > 0:
                now = time.monotonic()
                if now - last_round > timeout_s / 2:
                    # The parent itself did not run (the whole process group stopped: Ctrl-Z,
                    # `docker pause`, a frozen cgroup): the workers' silence is its own. Their
                    # clocks start over now rather than every worker being killed as hung.
                    for worker in running.values():
                        worker.listened_at = max(worker.listened_at, now)
                last_round = now
                for worker in _hung(running.values(), table, timeout_s):
                    hangs[worker.slot.index] += 1
                    status()
            if stopping:
                due.clear()
            now = time.monotonic()
            for index, (when, slot) in list(due.items()):
                if when > now:
                    continue
                del due[index]
                again = dataclasses.replace(slot, respawns=slot.respawns + 1)
                try:
                    worker_config, worker_reload = _config_for_replacement(config, reload, directory)
                    replacement = start(again, worker_config, worker_reload)
                except Exception:  # e.g. no memory for a process right after an OOM kill: retry
                    delay = backoff.delay_after_exit(index, 0.0)
                    log.exception("worker %d could not be started again; next try in %.1f s", index, delay)
                    due[index] = (time.monotonic() + delay, slot)
                    continue
                respawns[index] = again.respawns
                status()
                if stopping:  # the stop came while it was being started: the handler missed it
                    replacement.signal(signal.SIGTERM)
                log.warning("worker %d started again (respawn %d)", index, again.respawns)
    finally:
        table.close()
    if not stopping:  # every worker gone with nobody asking: a failure (a taken port …)
        log.error("every worker has exited without a stop signal")
        return 1
    return 1 if failed else 0


def _hung(workers: Iterable[_Worker], table: WorkerTable, timeout_s: float) -> list[_Worker]:
    """Kill each listening worker whose loop has not beaten for ``timeout_s``; its exit then
    comes as any other's (cells cleared, started again)."""
    now = time.monotonic()
    killed = []
    for worker in workers:
        if not worker.listening or worker.killed:
            continue
        silent_s = now - max(table.last_beat(worker.slot.index), worker.listened_at)
        if silent_s <= timeout_s:
            continue
        log.error("worker %d (pid %s): its event loop has not run for %.1f s (server.worker_timeout_s "
                  "%g); killing it", worker.slot.index, worker.process.pid, silent_s, timeout_s)  # fmt: skip
        worker.kill()
        killed.append(worker)
    return killed


def _reap(
    worker: _Worker,
    table: WorkerTable,
    stopping: bool,
    due: dict[int, tuple[float, WorkerSlot]],
    backoff: Backoff,
) -> bool:
    """A worker exited: clear its cells, schedule its replacement; whether it counts as failed."""
    process, slot = worker.process, worker.slot
    process.join()
    table.clear_worker(slot.index)
    remove_files_of(slot.directory, slot.index)
    listened = worker.read_started()
    worker.started.close()
    code = process.exitcode
    if stopping:  # one that never listened served nothing: ended by the stop, not failed
        return code != 0 and listened
    if not listened and slot.respawns == 0 and (code or 0) >= 0:
        log.error("worker %d (pid %s) exited with %s before it served; not started again",
                  slot.index, process.pid, code)  # fmt: skip
        return True
    delay = backoff.delay_after_exit(slot.index, time.monotonic() - worker.born)
    due[slot.index] = (time.monotonic() + delay, slot)
    log.warning("worker %d (pid %s) exited with %s; its shared load counts were cleared; "
                "starting it again in %.1f s", slot.index, process.pid, code, delay)  # fmt: skip
    return False


def _config_for_replacement(config: GatewayConfig, reload: Any, directory: str) -> tuple[GatewayConfig, Any]:
    """The config its siblings run (the ``server`` section is the start's either way), and the
    reload source with the digest of the file that config came from: the replacement's file
    watch then applies a change made since, as its siblings' watches do."""
    published = published_config(directory)
    if published is None:
        return config, reload
    running, digest = published
    running = running.model_copy(update={"server": config.server})
    if reload is not None:
        reload = dataclasses.replace(reload, digest=digest)
    return running, reload
