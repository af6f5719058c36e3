"""The fuzz tests share one live gateway per module (starting one per example would dominate)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fuzz.live import MAX_BODY_BYTES, MAX_HEADER_BYTES, MAX_HEADERS, LiveGateway, live_gateway


@pytest.fixture(scope="module")
def live() -> Iterator[LiveGateway]:
    with live_gateway(
        policy="session-aware",  # exercises session ids, signed session tokens and prefix hashing
        server={
            "max_body_bytes": MAX_BODY_BYTES,
            "max_headers": MAX_HEADERS,
            "max_header_bytes": MAX_HEADER_BYTES,
        },
    ) as gateway:
        yield gateway
