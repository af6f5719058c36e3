"""The simulator's half of prefill/decode disaggregation over HTTP: deciding how much of a
prompt arrives by KV transfer, claiming it from the prefill replica (NIXL-style params or
a bootstrap room), and the prefill side's answers (``/internal/pd/*``)."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
from aiohttp import web

from .engine import SimRequest
from .pd import REGISTRY, PrefillRecord, prompt_digest
from .wire import error_response


class PDHandlers:
    """Mixed into the replica's handlers; ``self.s`` is its ``SimState``."""

    s: Any

    async def _pd_prepare(self, body: dict[str, Any], tokens: list[int]) -> tuple[int, str, Any]:
        """Decide how many prompt tokens arrive by KV transfer. Returns (external tokens, kind, room)."""
        cfg = self.s.config
        params = body.get("kv_transfer_params")
        room = body.get("bootstrap_room")
        if isinstance(params, dict):
            if params.get("do_remote_decode"):
                return 0, "nixl_prefill", None
            if params.get("do_remote_prefill"):
                ok = await self._claim_nixl(params, tokens)
                return self._count(ok, tokens), "nixl_decode", None
        if room is not None and cfg.role in ("prefill", "decode"):
            if cfg.role == "prefill":
                return 0, "room_prefill", room
            ok = await self._claim_room(body, room, prompt_digest(tokens))
            return self._count(ok, tokens), "room_decode", room
        return 0, "", None

    async def _claim_nixl(self, params: dict[str, Any], tokens: list[int]) -> bool:
        """Same-process prefill: the shared registry; otherwise ask the replica at remote_host:remote_port."""
        engine_id = params.get("remote_engine_id")
        if engine_id in REGISTRY.engines:
            return REGISTRY.claim_nixl(params, tokens)
        host, port = params.get("remote_host"), params.get("remote_port")
        if not isinstance(host, str) or not isinstance(port, int) or self.s.client is None:
            return False
        claim = {
            "engine_id": engine_id,
            "request_id": params.get("remote_request_id"),
            "block_ids": params.get("remote_block_ids"),
            "digest": prompt_digest(tokens),
        }
        try:
            async with self.s.client.post(
                f"http://{host}:{port}/internal/pd/claim", json=claim, timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                return r.status == 200 and (await r.json()).get("ok") is True
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False

    async def _claim_room(self, body: dict[str, Any], room: Any, digest: int) -> bool:
        """Wait (bounded) for the room's prefill: in this process's registry, or long-polling the
        bootstrap server the body names (the prefill replica's HTTP port)."""
        cfg = self.s.config
        deadline = time.monotonic() + max(0.2, 5.0 / cfg.time_scale)
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        remote = None
        if (
            isinstance(host, str)
            and isinstance(port, int)
            and port != self.s.port
            and self.s.client is not None
        ):
            remote = f"http://{host}:{port}/internal/pd/room/{room}"
        while True:
            rec = REGISTRY.take_room(room)
            if rec is not None:
                return rec.digest == digest
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if remote is None:
                rec = await REGISTRY.wait_room(room, min(remaining, 0.05))
                if rec is not None:
                    return rec.digest == digest
                continue
            status = await self._poll_room(remote, digest, min(remaining, 0.25))
            if status in ("honoured", "mismatch"):
                return status == "honoured"
            if status is None:  # no bootstrap server there (e.g. same-process sims): registry only
                remote = None

    async def _poll_room(self, url: str, digest: int, wait_s: float) -> str | None:
        assert self.s.client is not None
        try:
            async with self.s.client.get(
                url,
                params={"digest": str(digest), "wait_s": f"{wait_s:.3f}"},
                timeout=aiohttp.ClientTimeout(total=wait_s + 2.0),
            ) as r:
                if r.status != 200:
                    return None
                return str((await r.json()).get("status"))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    # Served by every replica; only its own prefills answer.
    async def pd_claim(self, request: web.Request) -> web.Response:
        """vLLM-style pull: one-shot claim of a prefill this replica made."""
        try:
            c = await request.json()
            if not isinstance(c, dict):
                raise ValueError
        except (ValueError, UnicodeDecodeError):
            return error_response(400, "body must be a JSON object", "BadRequestError")
        if c.get("engine_id") != self.s.engine_id:
            return web.json_response({"ok": False, "reason": "unknown engine"})
        ok = REGISTRY.claim(c.get("engine_id"), c.get("request_id"), c.get("block_ids"), c.get("digest"))
        return web.json_response({"ok": ok})

    async def pd_room(self, request: web.Request) -> web.Response:
        """SGLang-style bootstrap server: long-poll for a room this replica prefilled; consumes it."""
        try:
            room = int(request.match_info["room"])
            digest = int(request.query["digest"])
            wait_s = min(30.0, max(0.0, float(request.query.get("wait_s", "0"))))
        except (KeyError, ValueError):
            return error_response(400, "need an integer room and ?digest=N[&wait_s=S]", "BadRequestError")
        rec = await REGISTRY.wait_room(room, wait_s, engine_id=self.s.engine_id)
        if rec is None:
            return web.json_response({"status": "absent"})
        return web.json_response({"status": "honoured" if rec.digest == digest else "mismatch"})

    def _count(self, ok: bool, tokens: list[int]) -> int:
        if ok:
            self.s.pd.honoured += 1
            return len(tokens) - 1
        self.s.pd.recomputed += 1
        return 0

    def _pd_finish(self, req: SimRequest, kind: str, room: Any) -> dict[str, Any] | None:
        if kind not in ("nixl_prefill", "room_prefill") or self.s.fault.mode == "no_transfer":
            return None
        if req.finish_reason == "abort":  # ended by shutdown: no KV worth handing over
            return None
        cfg = self.s.config
        rec = PrefillRecord(
            engine_id=self.s.engine_id,
            request_id=req.request_id,
            block_ids=list(req.last_block_ids),
            digest=prompt_digest(req.prompt_tokens),
            num_tokens=req.num_prompt_tokens,
            expires=time.monotonic() + cfg.pd_ttl_s,
        )
        REGISTRY.add_prefill(rec, room=room if kind == "room_prefill" else None)
        if kind == "room_prefill":
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.s.engine_id,
            "remote_block_ids": rec.block_ids,
            "remote_host": cfg.host,
            "remote_port": self.s.port or cfg.port,
            "remote_request_id": req.request_id,
            "tp_size": 1,
        }
