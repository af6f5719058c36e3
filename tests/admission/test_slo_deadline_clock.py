"""The drain pass judges a held request on one clock reading.

A drain pass that saw a waiter before its deadline but asked the predictor's verdict after
the deadline (a second clock read) took "deadline passed: no verdict" for "go" and sent a
request it should have dropped (``drop_overdue``) — CI caught it once as a 200 where
``test_with_drop_overdue_a_held_request_leaves_the_queue_at_its_deadline_with_429`` wanted
its 429. These tests drive the controller's own queue with a clock reading of their choice.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence

from gateway.admission.queue import AdmissionController, _Waiter
from gateway.admission.saturation import SaturationDetector
from gateway.config import AdmissionConfig
from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from gateway.request.types import ApiKind, InferenceRequest, Slo


class _NobodyInTime:
    """Every replica is predicted far too slow (1.6 s), as behind a long prefill queue."""

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        return None

    def best_ms(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> float | None:
        return 1600.0


def _controller(drop_overdue: bool) -> AdmissionController:
    config = AdmissionConfig.model_validate({"slo": {"drop_overdue": drop_overdue}})
    endpoint = Endpoint(url="http://127.0.0.1:9")
    return AdmissionController(
        config, SaturationDetector(config), GatewayMetrics(), lambda _model: [endpoint], ttft=_NobodyInTime()
    )


def _held(deadline: float) -> tuple[deque[_Waiter], _Waiter]:
    request = InferenceRequest(
        request_id="r", api=ApiKind.CHAT, model="m", body={}, raw_body=b"{}", stream=False,
        prompt_text="hello", est_prompt_tokens=2, slo=Slo(ttft_ms=300.0, deadline=deadline),
    )  # fmt: skip
    waiter = _Waiter(request, asyncio.get_running_loop().create_future(), due=deadline, slo_gated=True)
    return deque([waiter]), waiter


async def test_a_pass_that_saw_the_deadline_ahead_keeps_waiting_for_a_prediction() -> None:
    controller = _controller(drop_overdue=True)
    deadline = time.monotonic() - 0.001  # passed by the time the verdict would read the clock again
    queue, waiter = _held(deadline)
    # not sent: nobody in time
    assert controller._next_waiter(queue, now=deadline - 0.0005, grantable=True) is None
    assert not waiter.future.done()


async def test_a_pass_after_the_deadline_drops_it_with_drop_overdue() -> None:
    controller = _controller(drop_overdue=True)
    deadline = time.monotonic() - 0.001
    queue, waiter = _held(deadline)
    assert controller._next_waiter(queue, now=deadline + 0.0005, grantable=True) is None
    exception = waiter.future.exception()
    assert exception is not None and "slo_deadline_passed" in exception.code


async def test_without_drop_overdue_it_is_served_late_once_past_its_deadline() -> None:
    controller = _controller(drop_overdue=False)
    deadline = time.monotonic() - 0.001
    queue, waiter = _held(deadline)
    assert controller._next_waiter(queue, now=deadline + 0.0005, grantable=True) is waiter
