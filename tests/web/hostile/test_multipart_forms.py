"""Hostile audio forms (multipart/form-data), over real sockets (review findings, each failing before).

- a part's name and file-ness come from its Content-Disposition only, as the engine's parser
  reads them: a ``name="model"`` in another header showed the gateway one model (checked
  against the tenant's models) and the engine another;
- a body of delimiters is refused without splitting it all (~13x its size in memory);
- a boundary outside RFC 2046's characters is a 400, not a 500;
- fields the gateway drops (a tenant's ``priority``, the engines' P/D hand-over fields) are
  dropped from forms too.
"""

from __future__ import annotations

import tracemalloc

import pytest
import yaml
from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.auth import hash_key
from gateway.errors import BadRequest
from gateway.request.multipart import parse_form

KEY = "sk-form-tenant"
AUDIO = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(256))


def _keys(tmp_path, **tenant) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(
        yaml.safe_dump({"tenants": {"t": tenant}, "keys": [{"sha256": hash_key(KEY), "tenant": "t"}]})
    )
    return str(path)


def _part(headers: str, data: bytes, boundary: bytes = b"b0undary") -> bytes:
    return b"--" + boundary + b"\r\n" + headers.encode() + b"\r\n\r\n" + data + b"\r\n"


def _form(*parts: bytes, boundary: bytes = b"b0undary") -> bytes:
    return b"".join(parts) + b"--" + boundary + b"--\r\n"


async def _post(http, gw, body: bytes, content_type: str = "multipart/form-data; boundary=b0undary"):
    headers = {"content-type": content_type, "authorization": f"Bearer {KEY}"}
    async with http.post(gw.url + "/v1/audio/transcriptions", data=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_a_name_outside_the_content_disposition_is_no_name(
    start_upstream, start_gateway, http, tmp_path
):
    upstream = await start_upstream(models=("allowed", "secret-adapter"))
    auth = {"enabled": True, "keys_file": _keys(tmp_path, models=["allowed"])}
    gw = await start_gateway([upstream.url], auth=auth)
    file = _part('Content-Disposition: form-data; name="file"; filename="a.wav"', AUDIO)
    honest = _form(file, _part('Content-Disposition: form-data; name="model"', b"secret-adapter"))
    crafted = _form(
        file,
        _part('Content-Disposition: form-data; name="model"\r\nX-Note: filename=none', b"secret-adapter"),
        _part('Content-Disposition: form-data; name="prompt"\r\nX-Note: name="model"', b"allowed"),
    )
    assert (await _post(http, gw, honest))[0] == 403
    status, body = await _post(http, gw, crafted)
    assert status == 403, body  # old: 200, transcribed by secret-adapter
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("head", "message"),
    [
        (
            'Content-Disposition: form-data; name="a"\r\nContent-Disposition: form-data; name="b"',
            "two Content",
        ),
        ('Content-Disposition: form-data; name="model"; name="x"', "given twice"),
        ("Content-Disposition: form-data; name*=utf-8''model", "no form-data name"),
        ('Content-Type: text/plain; name="model"', "no form-data Content-Disposition"),
        ("Content-Disposition: form-data; name", "not key=value"),
        (' folded: name="model"', "not 'Name: value'"),
        ('Content-Disposition: form-data; name="\\model"', "backslash"),
        ('Content-Disposition: form-data; name="x\\\\"; foo="; name=model; bar="', "backslash"),
    ],
)
def test_ambiguous_part_heads_are_refused(head: str, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_form(_form(_part(head, b"x")), "multipart/form-data; boundary=b0undary")


def _engine_reads(body: bytes, boundary: bytes = b"b0undary") -> list[tuple[str, bool, bytes]]:
    """The parts as vLLM's form parser reads them: python-multipart's parser and its
    Content-Disposition reading (Starlette: a part with a ``filename`` is a file)."""
    parts: list[tuple[str, bool, bytes]] = []
    current: dict = {}

    def on_part_begin() -> None:
        current.clear()
        current.update(headers={}, field=b"", value=b"", data=bytearray())

    def on_header_field(data, start, end) -> None:
        current["field"] += data[start:end]

    def on_header_value(data, start, end) -> None:
        current["value"] += data[start:end]

    def on_header_end() -> None:
        current["headers"][current["field"].lower()] = current["value"]
        current["field"], current["value"] = b"", b""

    def on_part_data(data, start, end) -> None:
        current["data"] += data[start:end]

    def on_part_end() -> None:
        _, options = parse_options_header(current["headers"].get(b"content-disposition", b""))
        parts.append((options[b"name"].decode(), b"filename" in options, bytes(current["data"])))

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    }
    parser = MultipartParser(boundary, callbacks)
    parser.write(body)
    parser.finalize()
    return parts


_FILE = _part('Content-Disposition: form-data; name="file"; filename="a.wav"', AUDIO)


def _with_file(*parts: tuple[str, bytes]) -> bytes:
    """A form of an audio file and these (head, value) text parts."""
    return _form(_FILE, *(_part(head, value) for head, value in parts))


_MODEL = 'Content-Disposition: form-data; name="model"'
_SMUGGLED = {  # the re-review's three, and the first review's
    "filename* is no file to the engine": _with_file(
        (_MODEL, b"allowed"), (_MODEL + "; filename*=UTF-8''a.wav", b"secret-adapter")
    ),
    "a backslash before an ordinary character": _with_file(
        (_MODEL, b"secret-adapter"), ('Content-Disposition: form-data; name="\\model"', b"allowed")
    ),
    "an escaped backslash before a quote": _with_file(
        (_MODEL, b"allowed"),
        ('Content-Disposition: form-data; name="x\\\\"; foo="; name=model; bar="', b"secret-adapter"),
    ),
    "a name in another header": _with_file(
        (_MODEL + "\r\nX-Note: filename=none", b"secret-adapter"),
        ('Content-Disposition: form-data; name="prompt"\r\nX-Note: name="model"', b"allowed"),
    ),
    "a trailing semicolon": _with_file((_MODEL + ";", b"allowed")),
    "tokens, not quoted strings": _with_file(("Content-Disposition: form-data; name=model", b"allowed")),
}


@pytest.mark.parametrize("body", list(_SMUGGLED.values()), ids=list(_SMUGGLED))
def test_the_gateway_reads_a_form_as_the_engine_does_or_refuses_it(body: bytes) -> None:
    try:
        form = parse_form(body, "multipart/form-data; boundary=b0undary")
    except BadRequest:
        return  # refused: nothing reaches the engine
    mine = [(p.name, p.is_file, p.data) for p in form.parts]
    assert mine == _engine_reads(body)


def test_a_body_of_delimiters_is_refused_without_splitting_it_all() -> None:
    body = b"--aXY" * 1_000_000  # 5 MB
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest, match="more than 64 form parts"):
            parse_form(body, "multipart/form-data; boundary=a")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(body), peak  # old: ~13x (a million small bytes objects)


@pytest.mark.parametrize("boundary", ["ab\udcff", "ab€", "é", "a" * 71, "ends-in-space ", ""])
async def test_a_boundary_outside_rfc_2046_is_a_400(start_upstream, start_gateway, http, boundary) -> None:
    upstream = await start_upstream(models=("whisper",))
    gw = await start_gateway([upstream.url])
    encoded = boundary.encode("utf-8", "surrogateescape")
    body = _form(_part('Content-Disposition: form-data; name="model"', b"whisper", encoded), boundary=encoded)
    content_type = b'multipart/form-data; boundary="' + encoded + b'"'
    async with http.post(
        gw.url + "/v1/audio/transcriptions",
        data=body,
        headers={"content-type": content_type.decode("latin-1")},
    ) as resp:
        assert resp.status == 400, await resp.text()  # old: 500 for the non-ASCII ones
        assert "boundary" in (await resp.json())["error"]["message"]
    assert upstream.requests == []


async def test_dropped_fields_are_dropped_from_forms(start_upstream, start_gateway, http, tmp_path) -> None:
    upstream = await start_upstream(models=("whisper",))
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": _keys(tmp_path)})
    body = _form(
        _part('Content-Disposition: form-data; name="file"; filename="a.wav"', AUDIO),
        _part('Content-Disposition: form-data; name="model"', b"whisper"),
        _part('Content-Disposition: form-data; name="priority"', b"-100"),
        _part('Content-Disposition: form-data; name="bootstrap_host"', b"10.0.0.9"),
        _part('Content-Disposition: form-data; name="language"', b"en"),
        _part('Content-Disposition: form-data; name="timestamp_granularities[]"', b"word"),
        _part('Content-Disposition: form-data; name="timestamp_granularities[]"', b"segment"),
    )
    status, answer = await _post(http, gw, body)
    assert status == 200, answer
    (received,) = upstream.requests
    forwarded = parse_form(received.raw, received.headers["content-type"])
    fields = forwarded.fields()
    assert fields == {"model": "whisper", "language": "en", "timestamp_granularities[]": "segment"}  # old: +2
    repeated = [p.data for p in forwarded.parts if p.name == "timestamp_granularities[]"]
    assert repeated == [b"word", b"segment"]  # each its own value (re-encoded, they were the last one's)
    assert [p.data for p in forwarded.parts if p.is_file] == [AUDIO]
