"""The targets and their measurement: a hand check, then wrk runs with CPU sampled around them."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.harness.processes import ManagedProcess
from loadtest.harness.procfs import cpu_seconds, process_tree
from loadtest.harness.wrk import WrkResult, run_wrk
from loadtest.overhead.table import Row, line

__all__ = ["DEFAULT_VARIANTS", "MODEL", "VARIANTS", "WRK_DIR", "Bench", "Row", "check_target", "slug"]

WRK_DIR = Path(__file__).resolve().parent.parent / "wrk"
#: chat_session: the chat with an ``x-session-id`` (256 sessions in turn), agent traffic; not run by default
VARIANTS = {
    "chat": "chat.lua",
    "chat_stream": "chat_stream.lua",
    "chat_session": "chat_session.lua",
    "agent": "agent.lua",  # a 56 KB streamed turn with 20 tools
}
DEFAULT_VARIANTS = ["chat", "chat_stream"]
MODEL = "zero"


async def check_target(base_url: str, chunks: int = 8) -> list[str]:
    """One non-streaming and one streaming request by hand (``chunks`` events + ``[DONE]``);
    returns the problems found."""
    want = chunks + 1
    problems = []
    url = base_url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "check"}]
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        try:
            async with session.post(url, json={"model": MODEL, "messages": messages}) as resp:
                body = await resp.read()
                if resp.status != 200 or not json.loads(body).get("choices"):
                    problems.append(f"non-stream: HTTP {resp.status} {body[:200]!r}")
            async with session.post(url, json={"model": MODEL, "messages": messages, "stream": True}) as resp:
                text = (await resp.read()).decode(errors="replace")
                events = [line for line in text.splitlines() if line.startswith("data:")]
                if resp.status != 200 or len(events) != want or events[-1].strip() != "data: [DONE]":
                    problems.append(
                        f"stream: HTTP {resp.status}, {len(events)} data events (want {want}),"
                        f" ends {events[-1:]!r}"
                    )
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            problems.append(f"request failed: {exc!r}")
    return problems


class Bench:
    def __init__(self, args: argparse.Namespace, upstream: ManagedProcess, log_dir: Path) -> None:
        self.args = args
        self.upstream = upstream
        self.log_dir = log_dir
        self.rows: list[Row] = []
        self.wrk = args.wrk

    async def measure(
        self, target: str, kind: str, url: str, router_pid: int | None, config: dict[str, Any]
    ) -> None:
        problems = await check_target(url, getattr(self.args, "upstream_chunks", 8))
        if problems:
            print(f"  ! {target}: {'; '.join(problems)}", flush=True)
        upstream_pids = process_tree(self.upstream.pid)
        for variant in self.args.variants:
            if self.args.warmup > 0:
                await self.wrk_run(url, variant, self.args.warmup)
            router_pids = process_tree(router_pid) if router_pid else []
            cpu_r0, cpu_u0 = cpu_seconds(router_pids), cpu_seconds(upstream_pids)
            result, text = await self.wrk_run(url, variant, self.args.duration)
            cpu_r1, cpu_u1 = cpu_seconds(router_pids), cpu_seconds(upstream_pids)
            (self.log_dir / f"wrk-{slug(target)}-{variant}.txt").write_text(text)
            row = Row(
                target,
                kind,
                variant,
                result,
                router_cpu_s=(cpu_r1 - cpu_r0) if router_pid else None,
                upstream_cpu_s=cpu_u1 - cpu_u0,
                problems=list(problems),
                config=config,
            )
            self.rows.append(row)
            print("  " + line(row, self.direct(variant)), flush=True)

    async def wrk_run(self, url: str, variant: str, duration_s: float) -> tuple[WrkResult, str]:
        return await run_wrk(self.wrk, url, WRK_DIR / VARIANTS[variant], threads=self.args.threads,
                             connections=self.args.connections, duration_s=duration_s)  # fmt: skip

    def failed(self, target: str, kind: str, note: str) -> None:
        """A row per variant not measured for ``target``, so the table shows the gap."""
        for variant in self.args.variants:
            if not any(r.target == target and r.variant == variant for r in self.rows):
                self.rows.append(Row(target, kind, variant, None, note=note))

    def direct(self, variant: str) -> Row | None:
        for row in self.rows:
            if row.kind == "direct" and row.variant == variant and row.wrk is not None:
                return row
        return None


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")
