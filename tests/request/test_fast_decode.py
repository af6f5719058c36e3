"""The fast decoder (msgspec) and the precise path (json.loads + number hooks) agree exactly."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BadRequest
from gateway.request import guards
from gateway.request.guards import load_object


def precise(raw: bytes, depth: int = 32):
    """The guards as they were before the fast decoder: UTF-8, depth, then json.loads."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        pass  # _load_precise words it
    else:
        if guards.nesting_exceeds(raw, depth):
            raise BadRequest(f"request body nests deeper than {depth} levels", code="json_too_deep")
    long_digits = guards._LONG_DIGIT_RUN in raw.translate(guards._DIGITS_AS_ZERO)
    return guards._load_precise(raw, depth, long_digits)


def outcome(load, raw: bytes):
    try:
        body, numbers = load(raw)
        numbers.check_all()
    except BadRequest as exc:
        return ("error", str(exc), exc.code, exc.param)
    return ("ok", json.dumps(body, default=guards.refused_number_text, ensure_ascii=False))


EDGES = [
    b'{"a":1e400}', b'{"temperature":-1e400}', b'{"a":NaN}', b'{"a":Infinity}', b'{"a":-Infinity}',
    b'{"a":' + b"9" * 30 + b"}", b'{"a":' + b"9" * 308 + b"}", b'{"a":' + b"9" * 309 + b"}",
    b'{"max_tokens":' + b"9" * 400 + b"}", b'{"a":18446744073709551616}', b'{"a":1,"a":2}',
    b'{"a":"\\ud800"}', b'\xef\xbb\xbf{"a":1}', b'{"a":"\xff"}', b'{"a":"\xed\xa0\x80"}', b"[1]", b'"x"',
    b'{"a":1.7976931348623157e308}', b'{"a":1.8e308}', b'{"a":1e-400}', b'{"a":-0.0}', b'{"a":"\x01"}',
    b'{"a":1}\x00', b'{"a":01}', b"", b"{", b'{"a":[' * 40 + b"]" * 40 + b"}", b'{"a":[' * 40 + b"\xff",
    b'{"n":[1e400]}', b'{"a":"\\u0000"}', b"  {}  ",
]  # fmt: skip


@pytest.mark.parametrize("raw", EDGES)
def test_edges_same_as_precise(raw: bytes) -> None:
    assert outcome(lambda b: load_object(b, 32), raw) == outcome(precise, raw)


_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(), st.sampled_from(["1e400", "NaN", "\ud800", "x" * 30]),
)  # fmt: skip
_json = st.recursive(
    _leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4)
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.text(max_size=8), _json, max_size=6),
    st.sampled_from(["", "1e400", "NaN", "9" * 320]),
)
def test_random_bodies_same_as_precise(body: dict, splice: str) -> None:
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    if splice and raw != b"{}":
        raw = raw[:-1] + b', "z": ' + splice.encode() + b"}"
    assert outcome(lambda b: load_object(b, 32), raw) == outcome(precise, raw)
