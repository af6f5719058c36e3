"""Hostile-body guards, run on the raw bytes before any field is read.

Refused with a 400, never a 500: invalid UTF-8, nesting deeper than ``max_json_depth``,
more than ``max_json_containers`` arrays and objects, and non-finite or out-of-range numbers
(``1e400``, ``NaN``, 400-digit integers), reported with the field that held them. A body
too short to hold too many containers is decoded first (the decoders stop at the
interpreter's recursion limit) and its depth read from what was decoded; a longer one is
scanned on the raw bytes before any decoder sees it.

Bodies are decoded by msgspec (C, validates UTF-8, refuses NaN/Infinity and numbers past a
double); anything it refuses is decoded again by ``json.loads`` with the number hooks, the
precise path, which alone produces the error messages.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import msgspec

from gateway.errors import BadRequest, quoted
from gateway.request.fields import NUMBER_MAX

__all__ = ["load_object", "nesting_exceeds", "refused_number_text", "refused_shape"]

_NUMBER_MAX_INT = int(NUMBER_MAX)
_MAX_INT_DIGITS = len(str(_NUMBER_MAX_INT))  # longer literals are out of range; checked before int()
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * _MAX_INT_DIGITS

# The scan's first pass keeps brackets (as ``[]``), quotes, backslashes and the characters an
# escape can end with (as ``x``), so each backslash is still followed by its escape's end.
_KEPT = b'[]{}"\\/bfnrtu'
_SCAN_MAP = bytes.maketrans(b"{}/bfnrtu", b"[]xxxxxxx")
_NOT_KEPT = bytes(b for b in range(256) if b not in _KEPT)
_NOT_MARKS = bytes(b for b in range(256) if b not in b'[]"')
_SPLIT_SLICE = 1 << 20


def nesting_exceeds(raw: bytes, limit: int) -> bool:
    """True if arrays/objects in ``raw`` nest deeper than ``limit`` levels (``{}`` is 1)."""
    return refused_shape(raw, limit, sys.maxsize) == "depth"


def refused_shape(raw: bytes, max_depth: int, max_containers: int) -> str | None:
    """Why ``raw`` is refused before it is decoded: ``"depth"`` (nested deeper than
    ``max_depth`` levels, ``{}`` being 1), ``"containers"`` (more than ``max_containers``
    arrays and objects: decoding 15 MB of ``[[[…]]]`` towers held the event loop 4.7 s,
    ~0.6 µs a container, where a chat body has tens), or None.

    Runs without recursion, only C-speed bytes operations, one pass over the body and a
    few over what it keeps: keep brackets, quotes and escapes; drop escaped backslashes and
    quotes (left to right, as JSON reads escapes); keep only brackets and quotes; drop
    strings (``""`` pairs first: most strings hold no bracket, and dropping two adjacent
    quotes leaves every other character inside or outside a string as it was; the few left
    are split off by quote parity); count the openers; peel the innermost ``[]`` pairs
    up to ``max_depth`` times; a pair that survives was nested deeper. After ``p`` peels
    every remaining container holds ``p`` more levels, so a run of ``max_depth + 1 - p``
    openers proves the answer at once (this ends ``[[[[…`` bombs before the first peel).
    Exact for valid JSON; invalid JSON is refused by both decoders, which refuse deep
    nesting too (``RecursionError``), so there the scan only has to stay linear. A
    per-string regex took ~230 ms on a 12 MB body of tool schemas; this takes ~25.
    """
    reduced = raw.translate(_SCAN_MAP, _NOT_KEPT)
    if reduced.count(b"[") <= min(max_depth, max_containers):
        return None  # the common case: too few brackets to be too deep or too many
    if b"\\" in reduced:
        reduced = reduced.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = reduced.translate(None, _NOT_MARKS).replace(b'""', b"")
    # With adjacent quotes dropped, a bracket separates any two quotes left, and outside a string
    # it is one of a container's two: valid JSON within the bound keeps at most this many.
    if marks.count(b'"') > 4 * min(max_containers, sys.maxsize // 8) + 2:
        return "containers"
    skeleton = _outside_strings(marks) if b'"' in marks else marks
    if b"[" * (max_depth + 1) in skeleton:
        return "depth"  # a run of openers: the deep-nesting bomb, named as such whatever its size
    if skeleton.count(b"[") > max_containers or skeleton.count(b"]") > max_containers:
        return "containers"  # closers too: 15 MB of "]" after a deep start cost 32 full peels
    for peeled_levels in range(max_depth):
        if b"[" * (max_depth + 1 - peeled_levels) in skeleton:
            return "depth"
        peeled = skeleton.replace(b"[]", b"")
        if len(peeled) == len(skeleton):
            return None  # nothing left to peel (unbalanced input is json.loads's to report)
        skeleton = peeled
    return "depth" if b"[]" in skeleton else None


def _outside_strings(marks: bytes) -> bytes:
    """``marks`` (brackets and quotes) without what lies between quote pairs, a slice at a time:
    one split of 16 MB of ``"["["…`` made 8 million parts, 356 MB at once."""
    kept, inside = [], False
    for start in range(0, len(marks), _SPLIT_SLICE):
        parts = marks[start : start + _SPLIT_SLICE].split(b'"')
        kept.append(b"".join(parts[1 if inside else 0 :: 2]))
        inside ^= len(parts) % 2 == 0  # an odd number of quotes in the slice
    return b"".join(kept)


class _BadNumber:
    """Stands in for a refused number literal, so the error can name the field that held it."""

    __slots__ = ("literal",)

    def __init__(self, literal: str) -> None:
        self.literal = literal

    def describe(self) -> str:
        literal = self.literal
        shown = literal if len(literal) <= 24 else f"{literal[:12]}…({len(literal)} characters)"
        if literal in ("NaN", "Infinity", "-Infinity"):
            return f"{shown} is not valid JSON"
        return f"number {shown} is out of range"


class _NumberGuard:
    """``json.loads`` hooks: numbers past the double range (``1e400``, ``10**400``) and
    ``NaN``/``Infinity`` become :class:`_BadNumber`; the first one is remembered."""

    __slots__ = ("first",)

    def __init__(self) -> None:
        self.first: _BadNumber | None = None

    def integer(self, literal: str) -> int | _BadNumber:
        # The length check comes first: it keeps int() clear of the 4300-digit conversion limit.
        if len(literal) - literal.startswith("-") <= _MAX_INT_DIGITS:
            value = int(literal)
            if -_NUMBER_MAX_INT <= value <= _NUMBER_MAX_INT:
                return value
        return self.refuse(literal)

    def real(self, literal: str) -> float | _BadNumber:
        value = float(literal)
        return value if math.isfinite(value) else self.refuse(literal)  # 1e400 overflows to inf

    def refuse(self, literal: str) -> _BadNumber:
        bad = _BadNumber(literal)
        if self.first is None:
            self.first = bad
        return bad

    def check_fields(self, body: dict[str, Any]) -> None:
        """Name the top-level field holding a refused number (nested ones fail their own checks)."""
        if self.first is None:
            return
        for name, value in body.items():
            if isinstance(value, _BadNumber):
                raise BadRequest(
                    f"{quoted(name)}: {value.describe()}", param=name, code="number_out_of_range"
                )

    def check_all(self) -> None:
        """Refuse the body if a refused number sits anywhere no field check looked."""
        if self.first is not None:
            raise BadRequest(self.first.describe(), code="number_out_of_range")


# The fast decoder (issue 17: ~6x json.loads on chat bodies). It validates UTF-8 and refuses
# NaN/Infinity and numbers that overflow a double, and keeps integers exact (arbitrary size,
# like json.loads); whatever it refuses goes to the precise path below, which alone words
# the error, so the messages stay exactly those of json.loads and the number guard.
def _finite(literal: str) -> float:
    """msgspec's float hook: Python's own parse. msgspec 0.23 parses a float with an exponent
    past ~288 in ~15 µs (a slow path; ``float()``: ~0.2 µs), so 16 MB of ``1e308,`` held the
    event loop ~45 s. A non-finite value is refused here and worded by the precise path."""
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(literal)
    return value


_FAST = msgspec.json.Decoder(float_hook=_finite)


def load_object(
    raw_body: bytes, max_depth: int, max_containers: int = sys.maxsize
) -> tuple[dict[str, Any], _NumberGuard]:
    # A body of at most 2 x max_containers bytes cannot hold too many containers (each takes two
    # bytes): it is decoded first, and its nesting and integers are read from what was decoded,
    # ~2x cheaper than the raw scans on an agent's 56 KB body. Decoding a longer body could take
    # seconds (15 MB of [[[…]]] towers: 4.7 s), so a longer one is scanned before it is decoded.
    # So is a short body dense in values (a comma every 8 bytes or less, in 4 KB at its middle:
    # token ids, tiny arrays), where decoding first cost ~2x the scans (a 199 KB token-id prompt:
    # 1.0 → 0.7 ms; 66,000 empty arrays: 8.3 → 3.1 ms). Counting them all cost an agent body 17 µs.
    if len(raw_body) <= 2 * max_containers and not _dense(raw_body):
        body = _fast_decode(raw_body)
        if body is not _REFUSED:
            refused = decoded_refusal(body, max_depth)
            if refused == "depth":
                raise _too_deep(max_depth)
            if refused is None:
                return _an_object(body), _NumberGuard()
            return _load_precise(raw_body, max_depth, True)  # an integer past the range: named there
        _refuse_shape(raw_body, max_depth, max_containers)  # its errors come before the precise path's
        return _load_precise(raw_body, max_depth, _long_digits(raw_body))
    _refuse_shape(raw_body, max_depth, max_containers)
    long_digits = _long_digits(raw_body)
    if not long_digits and (body := _fast_decode(raw_body)) is not _REFUSED:
        return _an_object(body), _NumberGuard()
    return _load_precise(raw_body, max_depth, long_digits)


_REFUSED = object()  # what the fast decoder would not decode


def _fast_decode(raw_body: bytes) -> Any:
    """The decoded body, or ``_REFUSED``: invalid, or an edge the fast decoder rejects (e.g. a
    ``"\\ud800"`` escape): the precise path decides, and words the error."""
    try:
        return _FAST.decode(raw_body)
    except (msgspec.DecodeError, RecursionError):
        return _REFUSED


def _an_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _dense(raw_body: bytes) -> bool:
    """A comma every 8 bytes or less in the 4 KB at the body's middle (a hint, not a guard: either
    path refuses the same bodies)."""
    middle = len(raw_body) // 2
    return raw_body.count(b",", max(0, middle - 2048), middle + 2048) * 8 >= min(len(raw_body), 4096)


def _long_digits(raw_body: bytes) -> bool:
    """Whether a digit run as long as the double range's is in the body: without one no integer
    literal can leave it, and the precise path skips its per-integer hook (~0.3 µs an integer,
    e.g. for token-id prompts)."""
    return _LONG_DIGIT_RUN in raw_body.translate(_DIGITS_AS_ZERO)


def decoded_refusal(decoded: Any, max_depth: int) -> str | None:
    """Why a decoded body is refused: ``"depth"`` (arrays/objects nest deeper than ``max_depth``
    levels, ``{}`` being 1), ``"number"`` (an integer past the double range: the precise path
    words it, naming its field), or None. One pass over its containers, level by level,
    without recursion."""
    level = [decoded] if type(decoded) is dict or type(decoded) is list else []
    depth, big = 1, False
    while level:
        if depth > max_depth:
            return "depth"
        inner = []
        for container in level:
            if type(container) is list and (bounds := _scalar_bounds(container)) is not None:
                low, high = bounds  # all numbers, or all strings: nothing nested, one range check
                if type(low) is not str and not -_NUMBER_MAX_INT <= low <= high <= _NUMBER_MAX_INT:
                    big = True
                continue
            for value in container.values() if type(container) is dict else container:
                kind = type(value)
                if kind is dict or kind is list:
                    inner.append(value)
                elif kind is int and not -_NUMBER_MAX_INT <= value <= _NUMBER_MAX_INT:
                    big = True
        level, depth = inner, depth + 1
    return "number" if big else None


_SCALARS = (int, float, bool, str)


def _scalar_bounds(items: list[Any]) -> tuple[Any, Any] | None:
    """``(min, max)`` of a list that holds only numbers or only strings, found at C speed, else
    None: from a scalar first item, comparing it with a string, list, dict or None (against a
    number) raises TypeError at once. Token-id prompts walked a value at a time cost 4.5x their
    decode."""
    if not items or type(items[0]) not in _SCALARS:
        return None
    try:
        low, high = min(items), max(items)
    except TypeError:
        return None
    return low, high  # compared without error from a scalar: all numbers, or all strings


def _refuse_shape(raw_body: bytes, max_depth: int, max_containers: int) -> None:
    refused = refused_shape(raw_body, max_depth, max_containers)
    if refused is None:
        return
    try:
        raw_body.decode("utf-8")
    except UnicodeDecodeError as exc:  # invalid UTF-8 is reported first, as it always was
        raise BadRequest(f"request body is not valid UTF-8 (byte {exc.start})") from None
    if refused == "containers":
        raise BadRequest(
            f"request body holds more than {max_containers} arrays and objects", code="json_too_large"
        )
    raise _too_deep(max_depth)


def _too_deep(max_depth: int) -> BadRequest:
    return BadRequest(f"request body nests deeper than {max_depth} levels", code="json_too_deep")


def _load_precise(raw_body: bytes, max_depth: int, long_digits: bool) -> tuple[dict[str, Any], _NumberGuard]:
    try:
        text = raw_body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid UTF-8 (byte {exc.start})") from None
    guard = _NumberGuard()
    try:
        body = json.loads(
            text,
            parse_int=guard.integer if long_digits else None,
            parse_float=guard.real,
            parse_constant=guard.refuse,
        )
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # only reachable with malformed input the scan let through
        raise _too_deep(max_depth) from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    guard.check_fields(body)
    return body, guard


def refused_number_text(value: Any) -> str:
    """json.dumps fallback for a refused number; the request is refused before the text is used."""
    if isinstance(value, _BadNumber):
        return value.literal
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
