"""/v1/audio/transcriptions and /translations: multipart/form-data with ``model`` as a form
field, through the gateway with the official ``openai`` SDK, to controllable upstreams."""

from __future__ import annotations

import io

import openai
import pytest

from gateway.request.multipart import parse_form

AUDIO = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(256)) * 4  # opaque bytes: passed on as they came


def _form(received):
    return parse_form(received.raw, received.headers["content-type"])


async def test_transcription_and_translation_reach_a_replica_of_the_form_model(
    start_upstream, start_gateway, openai_client
):
    whisper, other = await start_upstream(models=("whisper",)), await start_upstream(models=("other",))
    gw = await start_gateway([whisper.url, other.url], policy="round-robin")
    client = openai_client(gw)
    raw = await client.audio.transcriptions.with_raw_response.create(
        model="whisper", file=("clip.wav", io.BytesIO(AUDIO), "audio/wav"), language="en", prompt="names: Ada"
    )
    assert raw.headers["x-gateway-endpoint"] == whisper.name
    assert raw.parse().text == "hello from the upstream"
    translated = await client.audio.translations.create(
        model="whisper", file=("clip.wav", AUDIO, "audio/wav")
    )
    assert translated.text == "hello from the upstream"
    assert not other.requests
    first, second = whisper.requests
    assert (first.path, second.path) == ("/v1/audio/transcriptions", "/v1/audio/translations")
    form = _form(first)
    assert form.fields() == {"model": "whisper", "language": "en", "prompt": "names: Ada"}
    assert [p.data for p in form.parts if p.is_file] == [AUDIO]  # the file byte for byte
    assert first.headers["content-type"].startswith("multipart/form-data; boundary=")


async def test_an_alias_rewrites_the_form_model(start_upstream, start_gateway, openai_client):
    v2 = await start_upstream(models=("whisper-v2",))
    gw = await start_gateway([v2.url], models={"whisper": "whisper-v2"})
    raw = await openai_client(gw).audio.transcriptions.with_raw_response.create(
        model="whisper", file=("clip.wav", AUDIO, "audio/wav"), temperature=0.2
    )
    assert raw.headers["x-gateway-model"] == "whisper-v2"
    form = _form(v2.requests[-1])
    assert form.fields() == {"model": "whisper-v2", "temperature": "0.2"}
    assert [p.data for p in form.parts if p.is_file] == [AUDIO]


@pytest.mark.parametrize(
    ("content_type", "body", "message"),
    [
        ("application/json", b'{"model": "whisper"}', "multipart/form-data"),
        ("multipart/form-data", b"--x\r\n", "boundary"),
        ("multipart/form-data; boundary=x", b"--x\r\nnope", "closing boundary"),
        (
            "multipart/form-data; boundary=x",
            b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nAAA\r\n--x--\r\n',
            "'model' is required",
        ),
        (
            "multipart/form-data; boundary=x",
            b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
            b'--x\r\nContent-Disposition: form-data; name="stream"\r\n\r\nmaybe\r\n--x--\r\n',
            "'stream' must be true or false",
        ),
    ],
)
async def test_bad_forms_are_400_before_any_replica(
    start_upstream, start_gateway, http, content_type, body, message
):
    whisper = await start_upstream(models=("whisper",))
    gw = await start_gateway([whisper.url])
    async with http.post(
        gw.url + "/v1/audio/transcriptions", data=body, headers={"content-type": content_type}
    ) as resp:
        assert resp.status == 400
        assert message in (await resp.json())["error"]["message"]
    assert not whisper.requests


async def test_an_unknown_form_model_is_a_404(start_upstream, start_gateway, openai_client):
    whisper = await start_upstream(models=("whisper",))
    gw = await start_gateway([whisper.url])
    with pytest.raises(openai.NotFoundError):
        await openai_client(gw).audio.transcriptions.create(model="nope", file=("a.wav", AUDIO, "audio/wav"))


def test_form_encode_changes_fields_and_keeps_files():
    raw = (
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nold\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        b"Content-Type: audio/wav\r\n\r\n" + AUDIO + b"\r\n--b--\r\n"
    )
    form = parse_form(raw, "multipart/form-data; boundary=b")
    assert form.encode(form.fields()) == raw  # unchanged fields: the same bytes
    again = parse_form(form.encode({"model": "new", "stream": True}), form.content_type)
    assert again.fields() == {"model": "new", "stream": True}
    assert [p.data for p in again.parts if p.is_file] == [AUDIO]


async def test_a_25_mb_audio_file_passes_where_a_json_body_that_large_is_refused(
    start_upstream, start_gateway, openai_client, http
):
    """OpenAI takes audio files up to 25 MB; ``server.max_body_bytes`` (16 MiB) bounds JSON bodies,
    ``server.max_form_body_bytes`` (26 MiB) the audio routes' multipart ones."""
    whisper = await start_upstream(models=("whisper",))
    gw = await start_gateway([whisper.url])
    big = AUDIO + bytes(25_000_000 - len(AUDIO))
    text = await openai_client(gw).audio.transcriptions.create(
        model="whisper", file=("long.wav", big, "audio/wav")
    )
    assert text.text == "hello from the upstream"
    assert [p.data for p in _form(whisper.requests[-1]).parts if p.is_file] == [big]
    with pytest.raises(openai.APIStatusError) as refused:
        await openai_client(gw).audio.transcriptions.create(
            model="whisper", file=("huge.wav", bytes(27 * 1024 * 1024), "audio/wav")
        )
    assert refused.value.status_code == 413
    assert refused.value.body["code"] == "request_too_large"
    padding = "x" * (17 * 1024 * 1024)
    async with http.post(
        gw.url + "/v1/chat/completions", json={"model": "whisper", "messages": [], "pad": padding}
    ) as resp:
        assert resp.status == 413


async def test_a_huge_field_name_is_not_echoed_whole(start_upstream, start_gateway, http):
    """A field name of 8 MB of invalid UTF-8 came back 12 times larger (each byte U+FFFD, each
    written ``\\ufffd``, in the message and as ``param``)."""
    whisper = await start_upstream(models=("whisper",))
    gw = await start_gateway([whisper.url])
    name = b"\xff" * 2_000_000
    body = (
        b'--x\r\nContent-Disposition: form-data; name="' + name + b'"\r\n\r\n\xff\r\n'
        b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n--x--\r\n'
    )
    headers = {"content-type": "multipart/form-data; boundary=x"}
    async with http.post(gw.url + "/v1/audio/transcriptions", data=body, headers=headers) as resp:
        raw = await resp.read()
        assert resp.status == 400
    assert len(raw) < 4096 and "not UTF-8" in (await resp.json())["error"]["message"]
    assert not whisper.requests
