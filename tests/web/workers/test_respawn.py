"""A worker that dies is started again: with the config its siblings run and the admin changes
it missed, counted in /metrics; signals sent while it starts wait for it; one that keeps dying
is started ever slower."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.http.supervisor import RESPAWN_DELAYS_S, STABLE_S, Backoff
from tests.support.workers import by_worker, children, spawn_gateway, worker_pids

KEY = "respawn-admin-key"
ADMIN = {"authorization": f"Bearer {KEY}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _worker_metrics(url: str) -> dict[str, float]:
    """The parent's counts as /metrics has them (each worker exports the same: the max over
    ``worker``): ``listening``, ``configured`` and ``slot <i>`` (its respawns)."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llm_gateway_worker_respawns_total":
                key = f"slot {sample.labels['slot']}"
            elif sample.name.startswith("llm_gateway_workers_"):
                key = sample.name.removeprefix("llm_gateway_workers_")
            else:
                continue
            found[key] = max(found.get(key, 0.0), sample.value)
    return found


def _config(urls: list[str]) -> str:
    endpoints = "".join(f"  - url: {url}\n    models: [m]\n" for url in urls)
    return (
        f"auth:\n  admin_key_sha256: {hashlib.sha256(KEY.encode()).hexdigest()}\n"
        "server:\n  drain_s: 0.2\n  shutdown_timeout_s: 1\n"
        f"scrape:\n  enabled: false\nendpoints:\n{endpoints}"
    )


async def _new_worker(gw, old: set[int]) -> int:
    """The pid of the worker started in place of a dead one."""
    for _ in range(300):
        kids = worker_pids(gw.pid)
        fresh = kids - old
        if len(kids) == 2 and fresh:
            return fresh.pop()
        await asyncio.sleep(0.05)
    raise AssertionError(f"no worker started again: children {children(gw.pid)}\n{gw.log_tail(3000)}")


async def _gateway(tmp_path, urls: list[str], new_session: bool = False):
    """``serve --workers 2`` with a config file (returned, to be changed) naming ``urls``."""
    config = tmp_path / "gw.yaml"
    config.write_text(_config(urls))
    args = ["--workers", "2", "--config", str(config)]
    return await spawn_gateway([], args, tmp_path, new_session=new_session), config


async def _kill_one_worker(gw) -> tuple[set[int], int]:
    """Both workers listening, then one SIGKILLed: (the workers before, its replacement's pid)."""
    async with by_worker(gw.url):
        old = worker_pids(gw.pid)
    os.kill(min(old), signal.SIGKILL)
    return old, await _new_worker(gw, old)


@contextlib.asynccontextmanager
async def _session_on(url: str, pid: int) -> AsyncIterator[aiohttp.ClientSession]:
    """A one-connection client session that the worker ``pid`` serves."""
    for _ in range(400):
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        try:
            async with session.get(url + "/ready") as resp:
                if resp.status == 200 and resp.headers["x-gateway-worker"] == str(pid):
                    break
        except aiohttp.ClientError:
            pass
        await session.close()
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"no connection reached worker {pid}")
    try:
        yield session
    finally:
        await session.close()


async def _admin_rows(session: aiohttp.ClientSession, url: str) -> dict[str, dict]:
    async with session.get(url + "/admin/endpoints", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        return {row["url"]: row for row in (await resp.json())["endpoints"]}


async def test_a_killed_worker_is_started_again_with_the_reloaded_config_and_the_admin_changes(
    start_sim, tmp_path
):
    sims = [await start_sim(model="m") for _ in range(3)]
    gw, config = await _gateway(tmp_path, [sims[0].url])
    try:
        async with by_worker(gw.url) as found:
            first, second = (sessions[0] for sessions in found.values())
            # a reload (the file gains an endpoint), then admin changes through the first worker
            config.write_text(_config([sims[0].url, sims[1].url]))
            os.kill(gw.pid, signal.SIGHUP)
            for _ in range(100):
                if sims[1].url in await _admin_rows(second, gw.url):
                    break
                await asyncio.sleep(0.05)
            async with first.post(
                gw.url + "/admin/endpoints", json={"url": sims[2].url, "models": ["m"]}, headers=ADMIN
            ) as resp:
                assert resp.status == 201, await resp.text()
            async with first.post(
                gw.url + "/admin/endpoints/drain", json={"url": sims[0].url}, headers=ADMIN
            ) as resp:
                assert resp.status == 200, await resp.text()
            before = await _admin_rows(first, gw.url)
            victim = next(pid for pid, sessions in found.items() if sessions[0] is second)
        old = worker_pids(gw.pid)
        os.kill(int(victim), signal.SIGKILL)
        fresh = await _new_worker(gw, old)
        async with _session_on(gw.url, fresh) as session:
            after = await _admin_rows(session, gw.url)
            assert set(after) == set(before) == {s.url for s in sims}, (after, gw.log_tail(3000))
            assert [u for u, row in after.items() if row["draining"]] == [sims[0].url], after
            for _ in range(10):  # it serves, and never on the drained replica
                async with session.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-gateway-endpoint"] != sims[0].url.split("://", 1)[1]
        counts = await _worker_metrics(gw.url)
        assert counts["configured"] == counts["listening"] == 2, counts
        assert sorted([counts["slot 0"], counts["slot 1"]]) == [0.0, 1.0], counts
        assert "worker 1" in gw.log_tail(5000) or "worker 0" in gw.log_tail(5000)
    finally:
        code = await gw.stop()
    assert code == 0, gw.log_tail(3000)  # a death recovered from is not a failed stop


async def test_a_killed_worker_and_its_replacement_killed_as_it_starts_are_both_replaced(start_sim, tmp_path):
    sims = [await start_sim(model="m") for _ in range(2)]
    gw, _ = await _gateway(tmp_path, [s.url for s in sims])
    try:
        async with by_worker(gw.url):  # both listen
            old = worker_pids(gw.pid)
        victim = min(old)
        os.kill(victim, signal.SIGKILL)
        replacement = await _new_worker(gw, old)
        os.kill(replacement, signal.SIGKILL)  # at once: it is still importing, not yet listening
        old = worker_pids(gw.pid) | {replacement}
        fresh = await _new_worker(gw, old)  # its second death in a minute: started after 0.5 s
        workers = worker_pids(gw.pid)
        assert fresh in workers and not {victim, replacement} & workers, (workers, gw.log_tail(3000))
        async with _session_on(gw.url, fresh):  # it listens (SO_REUSEPORT has its socket again)
            pass
        # every new connection is served, spread over both workers again
        served: dict[str, int] = {}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            for _ in range(60):
                async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200, await resp.text()
                    worker = resp.headers["x-gateway-worker"]
                    served[worker] = served.get(worker, 0) + 1
        assert set(served) == {str(p) for p in workers}, (served, workers)
        assert "starting it again in 0.5 s" in gw.log_tail(5000), gw.log_tail(3000)
    finally:
        await gw.stop()


def test_a_worker_that_keeps_dying_is_started_ever_slower_until_one_runs_stably():
    backoff = Backoff()
    delays = [backoff.delay_after_exit(0, ran_s=1.0) for _ in range(len(RESPAWN_DELAYS_S) + 5)]
    assert delays == [*RESPAWN_DELAYS_S, *[RESPAWN_DELAYS_S[-1]] * 5]  # a crash loop stays slow
    assert backoff.delay_after_exit(1, ran_s=1.0) == 0.0  # another slot has its own count
    assert backoff.delay_after_exit(0, ran_s=STABLE_S) == 0.0  # it ran a minute: at once again
    assert backoff.delay_after_exit(0, ran_s=1.0) == RESPAWN_DELAYS_S[1]


@pytest.mark.parametrize(
    ("signum", "to_group"),
    [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGHUP, True)],
    ids=["sigterm", "sighup", "sighup-to-the-group"],
)
async def test_a_signal_sent_while_a_replacement_starts_waits_for_it(start_sim, tmp_path, signum, to_group):
    """SIGTERM: the stop drains every worker and exits 0 (sent at once, it killed the half-started
    worker: exit 1). SIGHUP: the replacement reloads once it listens (sent at once, it died and
    was counted as a second death). SIGHUP to the process group (a terminal's hangup) reaches
    the starting replacement itself: it inherited the parent's handler, which exec makes the
    default, terminate (review finding); the first workers inherit an ignored SIGHUP."""
    sims = [await start_sim(model="m")]
    gw, _ = await _gateway(tmp_path, [sims[0].url], new_session=to_group)
    try:
        old, fresh = await _kill_one_worker(gw)
        await asyncio.sleep(0.05)  # it is importing: no handlers yet
        (os.killpg if to_group else os.kill)(gw.pid, signum)
        if signum == signal.SIGTERM:
            code = await asyncio.wait_for(gw.process.wait(), 30)
            assert code == 0, gw.log_tail(3000)
            assert "exited with -15" not in gw.log_tail(5000)
            return
        async with _session_on(gw.url, fresh):
            pass
        await asyncio.sleep(0.5)
        assert worker_pids(gw.pid) == (old - {min(old)}) | {fresh}, gw.log_tail(3000)
        counts = await _worker_metrics(gw.url)
        assert sorted([counts["slot 0"], counts["slot 1"]]) == [0.0, 1.0], counts
    finally:
        await gw.stop()


async def test_a_replacement_runs_what_its_siblings_run_not_a_file_they_refused(start_sim, tmp_path):
    """The file is turned into one the reload refuses (no endpoints left), then into bytes that
    are not UTF-8: the siblings keep their config, and so must a replacement (before, it ran
    the refused file, or the parent died on the decoding error)."""
    sims = [await start_sim(model="m") for _ in range(2)]
    gw, config = await _gateway(tmp_path, [sims[0].url])
    try:
        async with by_worker(gw.url) as found:
            first = next(iter(found.values()))[0]
            config.write_text(_config([sims[0].url, sims[1].url]))  # applied
            os.kill(gw.pid, signal.SIGHUP)
            for _ in range(100):
                if len(await _admin_rows(first, gw.url)) == 2:
                    break
                await asyncio.sleep(0.05)
        for bad in (b"scrape:\n  enabled: false\nendpoints: []\n", b"# caf\xe9\nendpoints: []\n"):
            config.write_bytes(bad)
            os.kill(gw.pid, signal.SIGHUP)  # refused by both workers
            await asyncio.sleep(0.3)
            old = worker_pids(gw.pid)
            os.kill(min(old), signal.SIGKILL)
            fresh = await _new_worker(gw, old)
            async with _session_on(gw.url, fresh) as session:
                rows = await _admin_rows(session, gw.url)
                assert set(rows) == {s.url for s in sims}, (bad, rows, gw.log_tail(3000))
                async with session.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200, await resp.text()
        assert gw.running, gw.log_tail(3000)
    finally:
        code = await gw.stop()
    assert code == 0, gw.log_tail(3000)


async def test_a_file_change_made_while_a_replacement_starts_reaches_it(start_sim, tmp_path):
    """No SIGHUP (a ConfigMap update): the siblings' file watch applies it, and so must the
    replacement's, though the change came after the config it was handed was made."""
    sims = [await start_sim(model="m") for _ in range(2)]
    gw, config = await _gateway(tmp_path, [sims[0].url])
    try:
        _, fresh = await _kill_one_worker(gw)
        config.write_text(_config([s.url for s in sims]))
        async with _session_on(gw.url, fresh) as session:
            for _ in range(100):  # the watch polls every 2 s
                if len(await _admin_rows(session, gw.url)) == 2:
                    break
                await asyncio.sleep(0.1)
            assert len(await _admin_rows(session, gw.url)) == 2, gw.log_tail(3000)
    finally:
        await gw.stop()


async def test_a_replacement_that_fails_to_start_is_retried(start_sim, tmp_path):
    """The first start failing (a taken port) is not retried; a replacement failing (the API key
    file of an endpoint gone while a Secret rotates) is, and starts once the file is back."""
    sims = [await start_sim(model="m")]
    key_file = tmp_path / "token"
    key_file.write_text("secret-token\n")
    config = tmp_path / "gw.yaml"
    config.write_text(
        "server:\n  drain_s: 0.2\n  shutdown_timeout_s: 1\nscrape:\n  enabled: false\n"
        f"endpoints:\n  - url: {sims[0].url}\n    models: [m]\n    api_key_file: {key_file}\n"
    )
    gw = await spawn_gateway([], ["--workers", "2", "--config", str(config)], tmp_path)
    try:
        async with by_worker(gw.url):
            old = worker_pids(gw.pid)
        key_file.unlink()
        os.kill(min(old), signal.SIGKILL)
        for _ in range(200):
            if gw.log_tail(20000).count("exited with 1") >= 2:  # failed, retried, failed again
                break
            await asyncio.sleep(0.05)
        assert "not started again" not in gw.log_tail(20000), gw.log_tail(3000)
        counts = await _worker_metrics(gw.url)  # seen by the surviving worker: one slot down
        assert counts["configured"] == 2 and counts["listening"] == 1, counts
        assert max(counts["slot 0"], counts["slot 1"]) >= 2, counts  # started again, and again
        key_file.write_text("secret-token\n")
        served_by: set[str] = set()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            for _ in range(600):  # a replacement started before the file was back fails too
                async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200, await resp.text()
                    served_by.add(resp.headers["x-gateway-worker"])
                if served_by - {str(p) for p in old}:
                    break
                await asyncio.sleep(0.05)
        assert served_by - {str(p) for p in old}, (served_by, gw.log_tail(3000))
    finally:
        code = await gw.stop()
    assert code == 0, gw.log_tail(3000)


@pytest.mark.parametrize("how", ["replacement-hangs", "group-sigint"])
async def test_a_stop_during_a_respawn_ends_at_once_and_exits_0(start_sim, tmp_path, how):
    """A replacement that has not listened serves nothing: a stop ends it at once (it may hang:
    here SIGSTOPped) and its death is no failure — also when the stop reached it directly
    (Ctrl-C or systemd signal the whole group, and it dies importing)."""
    sims = [await start_sim(model="m")]
    config = tmp_path / "gw.yaml"
    config.write_text(_config([sims[0].url]))
    gw = await spawn_gateway([], ["--workers", "2", "--config", str(config)], tmp_path, new_session=True)
    try:
        _, fresh = await _kill_one_worker(gw)
        if how == "replacement-hangs":
            os.kill(fresh, signal.SIGSTOP)
            os.kill(gw.pid, signal.SIGTERM)
        else:
            await asyncio.sleep(0.05)
            os.killpg(gw.pid, signal.SIGINT)
        code = await asyncio.wait_for(gw.process.wait(), 15)
        assert code == 0, gw.log_tail(3000)
    finally:
        await gw.stop()


async def test_a_replacement_does_not_make_the_config_it_was_handed_look_newest(start_sim, tmp_path):
    """Worker 0's replacement is handed config R1; while it starts, its sibling applies R2, then
    the file turns invalid. Had the replacement published R1 on starting, R1 would be the newest
    publication, and the next replacement would go back to it from R2."""
    sims = [await start_sim(model="m") for _ in range(2)]
    gw, config = await _gateway(tmp_path, [sims[0].url])
    try:
        old, fresh = await _kill_one_worker(gw)
        os.kill(fresh, signal.SIGSTOP)  # held before it listens
        sibling = next(iter(old - {min(old)}))
        config.write_text(_config([s.url for s in sims]))
        os.kill(gw.pid, signal.SIGHUP)  # the sibling applies R2 and publishes it
        async with _session_on(gw.url, sibling) as session:
            for _ in range(100):
                if len(await _admin_rows(session, gw.url)) == 2:
                    break
                await asyncio.sleep(0.05)
        config.write_text("endpoints: not-a-list\n")
        os.kill(fresh, signal.SIGCONT)
        async with _session_on(gw.url, fresh):
            pass
        os.kill(sibling, signal.SIGKILL)
        second = await _new_worker(gw, {sibling, fresh})
        async with _session_on(gw.url, second) as session:
            assert len(await _admin_rows(session, gw.url)) == 2, gw.log_tail(3000)
    finally:
        await gw.stop()
