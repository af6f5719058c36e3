"""The fast decoder (msgspec) and the precise path (json.loads + number hooks) agree exactly."""

from __future__ import annotations

import json
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BadRequest
from gateway.request import guards
from gateway.request.guards import load_object
from tests.support.json_shape import containers, depth


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
    b'{"n":[1e400]}', b'{"a":"\\u0000"}', b"  {}  ", b"1", b"null", b"true", b"[" * 40 + b"]" * 40,
    b'{"a":[{"b":' + b"9" * 400 + b"}]}", b'{"a":[-' + b"9" * 310 + b"]}", b'{"a":' + b"7" * 4300 + b"}",
    b'{"a":' + b"7" * 5000 + b"}", b'{"a":[' * 40 + b"9" * 400 + b"]" * 40 + b"}",
    b'{"s":"' + b"9" * 400 + b'"}',
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


_TRICKY_TEXT = st.text(alphabet='[]{}"\\ab/\n\u00e9', max_size=12)
_NESTED = st.recursive(
    st.none() | st.integers() | _TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY_TEXT, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=500, deadline=None)
@given(
    value=_NESTED,
    limit=st.integers(min_value=0, max_value=8),
    ascii_only=st.booleans(),
    split_slice=st.sampled_from([1, 3, 7, 1 << 20]),
)
def test_the_depth_scan_is_exact_on_valid_json(
    value: object, limit: int, ascii_only: bool, split_slice: int
) -> None:
    """Strings full of brackets, quotes and backslashes (escaped as JSON escapes them) never
    count as nesting, and every real level does, however the strings fall across the slices."""
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    with mock.patch.object(guards, "_SPLIT_SLICE", split_slice):
        assert guards.nesting_exceeds(raw, limit) is (depth(value) > limit)


@settings(max_examples=500, deadline=None)
@given(value=_NESTED, limit=st.integers(min_value=0, max_value=8))
def test_the_decoded_depth_check_is_exact(value: object, limit: int) -> None:
    """A short body is decoded first and its depth read from what was decoded: the same answer
    as the raw scan's, scalars (depth 0) included."""
    assert (guards.decoded_refusal(value, limit) == "depth") is (depth(value) > limit)
    raw = json.dumps({"v": value}).encode()
    with mock.patch.object(guards, "_dense", lambda _raw: False):
        decoded_first = outcome(lambda b: load_object(b, limit + 1), raw)  # 2 x maxsize: short
    with mock.patch.object(guards, "_dense", lambda _raw: True):  # short, but dense in values
        dense_short = outcome(lambda b: load_object(b, limit + 1), raw)
    assert dense_short == decoded_first
    scanned_first = outcome(lambda b: load_object(b, limit + 1, max_containers=len(b) // 2 - 1), raw)
    if scanned_first[0] == "error" and scanned_first[2] == "json_too_large":
        return  # the long path's own bound: not a depth answer
    assert decoded_first == scanned_first


def test_the_depth_scan_on_escape_runs_and_strings_of_brackets() -> None:
    deep_in_string = json.dumps({"a": "[" * 100 + '\\"' * 50 + "{" * 100}).encode()
    assert not guards.nesting_exceeds(deep_in_string, 2)
    escaped_then_deep = b'{"a": "\\\\", "b": [[[[[]]]]]}'  # the string ends after its escaped backslash
    assert guards.nesting_exceeds(escaped_then_deep, 5) and not guards.nesting_exceeds(escaped_then_deep, 6)
    quote_then_deep = b'{"a": "\\"", "b": [[[[[]]]]]}'  # an escaped quote does not end the string
    assert guards.nesting_exceeds(quote_then_deep, 5) and not guards.nesting_exceeds(quote_then_deep, 6)


def test_strings_are_dropped_across_the_scans_slices(monkeypatch) -> None:
    """The strings are split off a slice at a time (bounded memory); a string that spans a
    slice's end stays a string, and so do the brackets in it."""
    monkeypatch.setattr(guards, "_SPLIT_SLICE", 7)
    text = json.dumps({"a": "[[[[[[[[", "b": [[[["x"]]]], "c": '"]]]]]]"', "d": [{"e": "[{"}]}).encode()
    for limit in range(7):
        assert guards.nesting_exceeds(text, limit) is (limit < 5)


@settings(max_examples=400, deadline=None)
@given(value=_NESTED, most=st.integers(min_value=0, max_value=40))
def test_the_container_count_is_exact_on_valid_json(value: object, most: int) -> None:
    """Past ``most`` arrays and objects a body is refused, and never below it: brackets and
    quotes in strings do not count, nor do the cheap bounds taken before the count."""
    raw = json.dumps(value).encode()
    assert (guards.refused_shape(raw, 1000, most) == "containers") is (containers(value) > most)


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 32 + b"]" * 32 + b"[]" + b"]" * 1000,  # 32 deep, then closers: each peel copied them all
        b'["' + b'["' * 1000 + b"]",  # quotes between brackets: the split made a part per quote
        b"[" * 32 + b"]" * 32 + b"[]" + b']"' * 1000,
    ],
)
def test_bodies_that_made_the_scan_slow_are_refused_before_it(raw: bytes) -> None:
    assert guards.refused_shape(raw, 32, 100) == "containers"


@pytest.mark.parametrize(
    ("raw", "dense"),
    [
        (json.dumps({"prompt": list(range(5_000))}).encode(), True),  # token ids
        (b'{"input": [' + b"[]," * 5_000 + b"[]]}", True),
        (json.dumps({"messages": [{"role": "user", "content": "some words, " * 500}]}).encode(), False),
        (b"{}", False),
        (json.dumps({"prompt": list(range(400))}).encode(), True),  # under 4 KB: all of it counted
    ],
)
def test_bodies_dense_in_values_are_told_apart(raw: bytes, dense: bool) -> None:
    assert guards._dense(raw) is dense
    assert outcome(lambda b: load_object(b, 32, 100_000), raw) == outcome(precise, raw)
