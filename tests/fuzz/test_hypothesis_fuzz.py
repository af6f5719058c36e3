"""Property-based fuzzing of one live gateway over real HTTP.

Properties: a malformed or hostile request gets a 4xx — never a 5xx — with an OpenAI
error body ``{"error": {"message", "type", "code", "param"}}`` (``param`` naming the field
when a known field has the wrong type); and after every example the gateway still
serves a valid request correctly. Examples are derandomized so CI is reproducible.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.live import MAX_BODY_BYTES, MAX_HEADER_BYTES, MAX_HEADERS, LiveGateway
from tests.support.json_shape import containers
from tests.support.upstreams import CHUNKS

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
VALID: dict[str, dict[str, Any]] = {
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    COMPLETIONS: {"model": "tiny", "prompt": "hello", "max_tokens": 4},
    EMBEDDINGS: {"model": "tiny", "input": "hello"},
}
REQUIRED = {CHAT: ("model", "messages"), COMPLETIONS: ("model", "prompt"), EMBEDDINGS: ("model", "input")}
JSON_HEADERS = {"content-type": "application/json"}

FUZZ = settings(
    max_examples=100,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


@pytest.fixture(scope="module")
def client(live: LiveGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=15) as c:
        yield c


# ---- assertions ------------------------------------------------------------------------------


def assert_openai_error(resp: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """A 4xx (``status`` if given) whose body is exactly the gateway's OpenAI error object."""
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500])
    if status is not None:
        assert resp.status_code == status, resp.text[:500]
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    payload = resp.json()
    assert list(payload) == ["error"], payload
    error = payload["error"]
    assert set(error) == {"message", "type", "code", "param"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] is None or isinstance(error["code"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    return error


def assert_still_serves(live: LiveGateway, client: httpx.Client) -> None:
    resp = client.post(CHAT, json=VALID[CHAT])
    assert resp.status_code == 200, resp.text[:500]
    assert resp.json()["choices"][0]["message"]["content"] == "".join(CHUNKS)
    live.call(live.upstream.requests.clear)  # keep the recorder's memory flat across examples


def post_raw(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers=JSON_HEADERS)


# ---- strategies ------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
ARRAYS_AND_OBJECTS = st.lists(JSON_SCALARS, max_size=3) | st.dictionaries(
    st.text(max_size=5), JSON_SCALARS, max_size=3
)
FINITE = {"allow_nan": False, "allow_infinity": False}


def not_an_int_in(low: int, high: int = 2**31 - 1) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.integers(max_value=low - 1),
        st.integers(min_value=high + 1, max_value=2**64 - 1),
        st.floats(**FINITE).filter(lambda f: not f.is_integer() or not low <= f <= high),
        st.booleans(),
        st.text(max_size=10),
        ARRAYS_AND_OBJECTS,
    )


def not_a_number_in(low: float, high: float | None = None) -> st.SearchStrategy[Any]:
    out_of_range = [st.floats(max_value=low - 1e-6, **FINITE)]
    if high is not None:
        out_of_range.append(st.floats(min_value=high + 1e-6, **FINITE))
    return st.one_of(*out_of_range, st.booleans(), st.text(max_size=10), ARRAYS_AND_OBJECTS)


NOT_A_BOOL = st.one_of(st.integers(), st.floats(**FINITE), st.text(max_size=10), ARRAYS_AND_OBJECTS)
NOT_A_STRING = st.one_of(st.integers(), st.floats(**FINITE), st.booleans(), ARRAYS_AND_OBJECTS)
NOT_TEXT_OR_TOKENS = st.one_of(
    st.just(""),
    st.just([]),
    st.integers(),
    st.floats(**FINITE),
    st.booleans(),
    st.dictionaries(st.text(max_size=5), JSON_SCALARS, max_size=3),
    st.just(["a", 1]),
    st.just([[]]),
    st.just([True, False]),
    st.lists(st.lists(st.text(max_size=3), min_size=1, max_size=2), min_size=1, max_size=2),
)
NOT_MESSAGES = st.one_of(
    st.none(),
    st.just([]),
    st.text(max_size=10),
    st.integers(),
    st.dictionaries(st.text(max_size=5), JSON_SCALARS, max_size=3),
)
NOT_STOP = st.one_of(
    st.integers(),
    st.booleans(),
    st.dictionaries(st.text(max_size=5), JSON_SCALARS, min_size=1, max_size=2),
    st.lists(st.integers(), min_size=1, max_size=3),
)
COMMON_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.none(), st.just(""), NOT_A_STRING),
    "stream": NOT_A_BOOL,
    "n": not_an_int_in(1),
    "temperature": not_a_number_in(0),
    "top_p": not_a_number_in(0, 1),
    "top_k": not_an_int_in(-1),
    "presence_penalty": not_a_number_in(-2, 2),
    "frequency_penalty": not_a_number_in(-2, 2),
    "seed": st.one_of(
        st.floats(**FINITE).filter(lambda f: not f.is_integer()),
        st.booleans(),
        st.text(max_size=5),
        ARRAYS_AND_OBJECTS,
    ),
    "stop": NOT_STOP,
}
# (path, field) → values the engines would reject; the gateway must 400 naming the field.
WRONG_FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    CHAT: {
        **COMMON_FIELDS,
        "messages": NOT_MESSAGES,
        "max_tokens": not_an_int_in(1),
        "max_completion_tokens": not_an_int_in(1),
        "logprobs": NOT_A_BOOL,
        "top_logprobs": not_an_int_in(0),
    },
    COMPLETIONS: {
        **COMMON_FIELDS,
        "prompt": NOT_TEXT_OR_TOKENS,
        "max_tokens": not_an_int_in(0),
        "logprobs": not_an_int_in(0),
        "echo": NOT_A_BOOL,
    },
    EMBEDDINGS: {
        "model": st.one_of(st.none(), st.just(""), NOT_A_STRING),
        "input": NOT_TEXT_OR_TOKENS,
        "encoding_format": st.one_of(
            NOT_A_STRING, st.text(max_size=8).filter(lambda s: s not in ("float", "base64"))
        ),
        "dimensions": not_an_int_in(1),
    },
}
PATHS = st.sampled_from([CHAT, COMPLETIONS, EMBEDDINGS])


@st.composite
def wrong_field(draw: st.DrawFn) -> tuple[str, dict[str, Any], str]:
    path = draw(PATHS)
    field = draw(st.sampled_from(sorted(WRONG_FIELDS[path])))
    body = dict(VALID[path])
    value = draw(WRONG_FIELDS[path][field])
    if value is None:
        body.pop(field, None)  # a required field missing (null is fine for optional ones)
    else:
        body[field] = value
    return path, body, field


@st.composite
def wrong_message(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A chat body whose first message is wrong; returns the body and the expected param."""
    case = draw(st.sampled_from(["message", "role", "content", "part", "name"]))
    message: Any = {"role": "user", "content": "hi"}
    if case == "message":
        message, param = draw(st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=2))), "messages.0"
    elif case == "role":
        message["role"], param = draw(st.one_of(st.just(""), NOT_A_STRING)), "messages.0.role"
    elif case == "content":
        message["content"] = draw(
            st.one_of(
                st.integers(),
                st.floats(**FINITE),
                st.booleans(),
                st.dictionaries(st.text(max_size=5), JSON_SCALARS, max_size=2),
            )
        )
        param = "messages.0.content"
    elif case == "part":
        message["content"] = [
            draw(
                st.one_of(
                    JSON_SCALARS,
                    st.just({"text": "no type"}),
                    st.just({"type": "text"}),
                    st.fixed_dictionaries({"type": st.just("text"), "text": NOT_A_STRING}),
                )
            )
        ]
        param = "messages.0.content"
    else:
        message["name"], param = draw(NOT_A_STRING), "messages.0.name"
    return {**VALID[CHAT], "messages": [message]}, param


# Number literals past the double range (or not JSON at all): json.dumps cannot write them.
HUGE_LITERALS = st.one_of(
    st.sampled_from(["1e400", "-1e400", "1E+999", "NaN", "Infinity", "-Infinity", "2e308"]),
    st.integers(min_value=310, max_value=6000).map(lambda n: "9" * n),  # past 4300 digits int() would raise
    st.integers(min_value=309, max_value=400).map(lambda n: "-1" + "0" * n),
    st.integers(min_value=309, max_value=100_000).map(lambda e: f"1.5e{e}"),
)


@st.composite
def huge_number_body(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body with one hostile number literal in a known field, an unknown one, or nested deep-ish."""
    path = draw(PATHS)
    literal = draw(HUGE_LITERALS)
    where = draw(st.sampled_from(["max_tokens", "temperature", "seed", "unknown", "nested", "token-id"]))
    placeholder = "__HOSTILE__"
    body = dict(VALID[path])
    if where == "nested":
        body["extra"] = {"a": [1, {"b": placeholder}]}
    elif where == "token-id" and path != CHAT:
        body["prompt" if path == COMPLETIONS else "input"] = [1, 2, placeholder]
    else:
        body["x_unknown" if where in ("unknown", "token-id") else where] = placeholder
    return path, json.dumps(body).replace(f'"{placeholder}"', literal).encode()


@st.composite
def deep_body(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    """Nesting past the limit (32): closed (valid JSON, too deep) or left open (truncated)."""
    path = draw(PATHS)
    depth = draw(st.sampled_from([33, 34, 100, 999, 1001, 5_000, 100_000]))  # 8 bytes a level: < 1 MiB
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}"), ('[{"a":', "}]")]))
    closed = draw(st.booleans())
    nested = opener * depth + "1" + (closer * depth if closed else "")
    body = json.dumps({**VALID[path], "deep": "__DEEP__"}).replace('"__DEEP__"', nested)
    if not closed:
        body = body[: body.index(nested) + len(nested)]
    return path, body.encode(), closed


@st.composite
def broken_encoding(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(PATHS)
    junk = draw(
        st.binary(min_size=1, max_size=64).filter(lambda b: not _is_utf8(b))
        | st.sampled_from([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"])
    )
    text = json.dumps(VALID[path]).encode()
    at = draw(st.integers(min_value=0, max_value=len(text)))
    return path, text[:at] + junk + text[at:]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@st.composite
def malformed_body(draw: st.DrawFn) -> tuple[str, bytes]:
    """Non-object top levels, truncations, missing required fields, random bytes."""
    path = draw(PATHS)
    kind = draw(st.sampled_from(["top-level", "truncated", "missing", "random", "empty"]))
    valid = json.dumps(VALID[path]).encode()
    if kind == "top-level":
        value = draw(ANY_JSON.filter(lambda v: not isinstance(v, dict)))
        return path, json.dumps(value).encode()
    if kind == "truncated":
        return path, valid[: draw(st.integers(min_value=0, max_value=len(valid) - 1))]
    if kind == "missing":
        drop = draw(st.lists(st.sampled_from(REQUIRED[path]), min_size=1, unique=True))
        return path, json.dumps({k: v for k, v in VALID[path].items() if k not in drop}).encode()
    if kind == "empty":
        return path, b""
    return path, draw(st.binary(max_size=512))


# ---- body properties ---------------------------------------------------------------------------


@FUZZ
@given(case=wrong_field())
def test_wrong_type_or_range_is_400_naming_the_field(live, client, case):
    path, body, field = case
    error = assert_openai_error(client.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field, error
    assert_still_serves(live, client)


@FUZZ
@given(case=wrong_message())
def test_wrong_message_is_400_naming_it(live, client, case):
    body, param = case
    error = assert_openai_error(client.post(CHAT, json=body), 400)
    assert error["param"] == param, error
    assert_still_serves(live, client)


@FUZZ
@given(case=huge_number_body())
def test_huge_and_non_finite_numbers_are_400(live, client, case):
    path, raw = case
    error = assert_openai_error(post_raw(client, path, raw), 400)
    assert error["type"] == "invalid_request_error"
    assert_still_serves(live, client)


@settings(FUZZ, max_examples=30)
@given(case=deep_body())
def test_deep_nesting_is_400(live, client, case):
    path, raw, closed = case
    error = assert_openai_error(post_raw(client, path, raw), 400)
    if closed:  # valid JSON, only too deep
        assert error["code"] == "json_too_deep", error
        assert "32" in error["message"]
    assert_still_serves(live, client)


@pytest.mark.parametrize(("depth", "status"), [(32, 200), (33, 400)])
def test_depth_limit_is_exact(live, client, depth, status):
    """The body object is level 1, so an array nested ``depth - 1`` deep inside it reaches ``depth``."""
    nested = "[" * (depth - 1) + "]" * (depth - 1)
    raw = json.dumps({**VALID[CHAT], "x_nested": "__N__"}).replace('"__N__"', nested).encode()
    resp = post_raw(client, CHAT, raw)
    if status == 200:
        assert resp.status_code == 200, resp.text[:300]
    else:
        assert assert_openai_error(resp, 400)["code"] == "json_too_deep"
    assert_still_serves(live, client)


@pytest.mark.parametrize(("total", "status"), [(100_000, 200), (100_001, 400)])
def test_container_limit_is_exact(live, client, total, status):
    """``server.max_json_containers`` (100,000 arrays and objects, the body's own included):
    past it a body is refused before it is decoded (15 MB of nested towers held the event
    loop 4.7 s)."""
    empties = total - containers(VALID[CHAT]) - 1  # the array that holds them is one more
    nested = "[" + ",".join(["[]"] * empties) + "]"
    raw = json.dumps({**VALID[CHAT], "x_many": "__N__"}).replace('"__N__"', nested).encode()
    resp = post_raw(client, CHAT, raw)
    if status == 200:
        assert resp.status_code == 200, resp.text[:300]
    else:
        error = assert_openai_error(resp, 400)
        assert error["code"] == "json_too_large" and "100000" in error["message"], error
    assert_still_serves(live, client)


def test_brackets_in_strings_are_no_containers(live, client):
    raw = json.dumps({**VALID[CHAT], "x_text": "[{" * 150_000}).encode()
    assert post_raw(client, CHAT, raw).status_code == 200
    assert_still_serves(live, client)


@FUZZ
@given(case=broken_encoding())
def test_invalid_utf8_is_400(live, client, case):
    path, raw = case
    assert_openai_error(post_raw(client, path, raw), 400)
    assert_still_serves(live, client)


@FUZZ
@given(case=malformed_body())
def test_malformed_bodies_are_400(live, client, case):
    path, raw = case
    assert_openai_error(post_raw(client, path, raw), 400)
    assert_still_serves(live, client)


@settings(FUZZ, max_examples=8)
@given(size=st.integers(min_value=64 * 1024, max_value=MAX_BODY_BYTES - 4096), path=PATHS)
def test_gigantic_strings_under_the_limit(live, client, size, path):
    """Gigantic model names get a 404; gigantic wrong-typed fields a 400 — never a 5xx."""
    body = {**VALID[path], "model": "m" * size}
    error = assert_openai_error(client.post(path, json=body), 404)
    assert error["code"] == "model_not_found"
    body = {**VALID[path], "stream": "s" * size}
    assert assert_openai_error(client.post(path, json=body), 400)["param"] == "stream"
    assert_still_serves(live, client)


@pytest.mark.parametrize("size", [MAX_BODY_BYTES + 1, 3 * MAX_BODY_BYTES])
def test_body_over_max_body_bytes_is_413(live, client, size):
    body = json.dumps({**VALID[CHAT], "pad": ""}).encode()
    body = body[:-2] + b"x" * (size - len(body)) + body[-2:]
    assert len(body) == size
    error = assert_openai_error(post_raw(client, CHAT, body), 413)
    assert error["code"] == "request_too_large"
    assert_still_serves(live, client)


# ---- headers, over a raw socket: every byte the client sends is ours ---------------------------

GATEWAY_HEADERS = [  # every request header the gateway itself reads (default names)
    "x-session-id",
    "x-session-token",
    "x-priority",
    "x-tenant-id",
    "x-request-id",
    "x-gateway-debug",
    "authorization",
]
OTHER_HEADERS = ["content-type", "accept", "accept-encoding", "user-agent", "expect", "x-forwarded-for"]
TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
UNICODE_TEXT = st.text(st.characters(exclude_categories=("Cs", "Cc")), max_size=30)
# Values the HTTP parser lets through to the gateway: visible ASCII, space, tab and obs-text (0x80-0xff).
PARSEABLE_VALUES = st.one_of(
    UNICODE_TEXT.map(str.encode),  # printable non-ASCII as UTF-8
    st.binary(max_size=40).map(lambda b: bytes(c for c in b if (c >= 0x20 and c != 0x7F) or c == 0x09)),
    st.tuples(st.text(TOKEN_CHARS, max_size=12), UNICODE_TEXT).map(lambda t: f"{t[0]}.{t[1]}".encode()),
    st.sampled_from([b"critical", b"SHEDDABLE", b" standard ", b"1", b"", b"YQ.\xff", b"\xe2\x82\xac"]),
    st.integers(min_value=100, max_value=900).map(lambda n: b"v" * n),  # long, under max_header_bytes
)


def raw_request(
    live: LiveGateway, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
) -> http.client.HTTPResponse:
    head = [
        b"POST %s HTTP/1.1" % path.encode(),
        b"Host: %s:%d" % (live.host.encode(), live.port),
        b"Connection: close",
        b"Content-Length: %d" % len(body),
    ]
    head += [name + b": " + value for name, value in headers]
    sock = socket.create_connection((live.host, live.port), timeout=10)
    try:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        response.body = response.read()  # type: ignore[attr-defined]
        return response
    finally:
        sock.close()


def assert_gateway_answer(resp: http.client.HTTPResponse) -> None:
    """A response the gateway made (it carries x-request-id): a success, or an OpenAI 4xx."""
    assert resp.status < 500, (resp.status, resp.body[:500])
    assert resp.getheader("x-request-id"), (resp.status, resp.getheaders())
    payload = json.loads(resp.body)
    if resp.status >= 400:
        assert set(payload["error"]) == {"message", "type", "code", "param"}, payload
    else:
        assert resp.status == 200
        assert payload["object"] in ("chat.completion", "text_completion", "list")


@settings(FUZZ, max_examples=150)
@given(path=PATHS, headers=st.dictionaries(st.sampled_from(GATEWAY_HEADERS), PARSEABLE_VALUES, max_size=5))
def test_gateway_headers_with_hostile_values_never_5xx(live, client, path, headers):
    """Headers the gateway reads, with values the parser passes on: non-ASCII, long, forged tokens."""
    pairs = [(name.encode(), value) for name, value in headers.items()]
    resp = raw_request(live, path, json.dumps(VALID[path]).encode(), pairs)
    assert_gateway_answer(resp)
    if resp.status >= 400:
        assert json.loads(resp.body)["error"]["param"] == "x-priority", resp.body[:300]
    assert_still_serves(live, client)


HEADER_NAMES = st.one_of(
    st.sampled_from(GATEWAY_HEADERS + OTHER_HEADERS),
    st.text(TOKEN_CHARS, min_size=1, max_size=40),
    st.binary(min_size=1, max_size=20).filter(lambda b: b":" not in b and b"\r\n" not in b),  # often invalid
)
RAW_VALUES = st.one_of(
    PARSEABLE_VALUES,
    st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),  # controls, lone surrogates
    st.binary(max_size=40),
).filter(lambda b: b"\r\n" not in b)


@settings(FUZZ, max_examples=100)
@given(path=PATHS, headers=st.lists(st.tuples(HEADER_NAMES, RAW_VALUES), max_size=MAX_HEADERS - 6))
def test_raw_header_bytes_never_5xx(live, client, path, headers):
    """Arbitrary header bytes: aiohttp's parser may refuse them (a plain-text 400/417, before the
    gateway); whatever it lets through gets a gateway answer, never a 5xx."""
    pairs = [(name.encode() if isinstance(name, str) else name, value) for name, value in headers]
    resp = raw_request(live, path, json.dumps(VALID[path]).encode(), pairs)
    assert resp.status < 500, (resp.status, resp.body[:500])
    if resp.getheader("x-request-id") is None:  # refused by the HTTP parser
        assert resp.status in (400, 417, 431), (resp.status, resp.body[:300])
    else:
        assert_gateway_answer(resp)
    assert_still_serves(live, client)


def test_too_many_headers_is_refused(live, client):
    headers = [(b"x-filler-%d" % i, b"v") for i in range(MAX_HEADERS + 8)]
    resp = raw_request(live, CHAT, json.dumps(VALID[CHAT]).encode(), headers)
    assert resp.status in (400, 431), (resp.status, resp.body[:300], "server.max_headers not wired?")
    assert_still_serves(live, client)


@pytest.mark.parametrize("where", ["value", "name"])
def test_header_over_max_header_bytes_is_refused(live, client, where):
    big = b"h" * (3 * MAX_HEADER_BYTES)
    header = (b"x-big", big) if where == "value" else (b"x-" + big, b"v")
    resp = raw_request(live, CHAT, json.dumps(VALID[CHAT]).encode(), [header])
    assert resp.status in (400, 431), (resp.status, resp.body[:300], "server.max_header_bytes not wired?")
    assert_still_serves(live, client)
