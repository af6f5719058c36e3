"""``multipart/form-data`` requests (the audio APIs): the text fields read, the body kept.

``POST /v1/audio/transcriptions`` and ``/translations`` carry the audio as a file part
and ``model`` (and ``language``, ``prompt``, ``stream``, ...) as form fields. The gateway
reads the text fields it routes by, keeps the raw body to send as it came, and re-encodes
it only when it changes a field (an alias's target, degrade): :meth:`Form.encode`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.errors import BadRequest, quoted

__all__ = ["Form", "parse_form"]

# RFC 2046: 1-70 of these, the last not a space. Anything else (a byte that is no ASCII) could be
# split on one way here and written another way in the forwarded Content-Type.
_BOUNDARY = re.compile(r'boundary=(?:"([^"]*)"|([^";\s]*))', re.IGNORECASE)
_BCHARS = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
# Content-Disposition's parameters: a token, "=", a token or a quoted string. No backslash
# anywhere: parsers disagree on escapes (python-multipart, vLLM's, unescapes only \\ and \",
# and splits parameters on quotes without minding an escaped backslash), and a disagreement
# on where a value ends is a disagreement on the part's name.
_PARAM = re.compile(rb'\s*;\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*(?:"([^"]*)"|([^;"\s]+))\s*')
_TRAILING = re.compile(rb"\s*;?\s*")
_MAX_FIELD_BYTES = 65536
_MAX_PARTS = 64


@dataclass(frozen=True, slots=True)
class _Part:
    headers: bytes
    name: str
    data: bytes
    is_file: bool


@dataclass(frozen=True, slots=True)
class Form:
    boundary: bytes
    parts: tuple[_Part, ...]

    @property
    def content_type(self) -> str:
        return f'multipart/form-data; boundary="{self.boundary.decode()}"'  # quoted: it may hold a space

    def fields(self) -> dict[str, object]:
        """The text fields (a repeated name: its last value)."""
        out: dict[str, object] = {}
        for part in self.parts:
            if not part.is_file:
                try:
                    out[part.name] = part.data.decode()
                except UnicodeDecodeError:
                    message = f"form field {quoted(part.name)} is not UTF-8 text"
                    raise BadRequest(message, param=part.name) from None
        if "stream" in out:  # a form says "true"; the rest of the gateway reads a JSON boolean
            flag = str(out.pop("stream")).strip().lower()
            if flag not in ("true", "false", "1", "0"):
                raise BadRequest("'stream' must be true or false", param="stream")
            out["stream"] = flag in ("true", "1")
        return out

    def encode(self, fields: dict[str, object]) -> bytes:
        """The body again, with text fields changed, added or removed as in ``fields`` (files as
        they came): a field the gateway dropped (a tenant's ``priority``) must not reach the engine."""
        seen: set[str] = set()
        chunks: list[bytes] = []
        was = self.fields()
        for part in self.parts:
            data = part.data
            if not part.is_file:
                if part.name not in fields:
                    continue
                if part.name not in was or _text(fields[part.name]) != _text(was[part.name]):
                    data = _text(fields[part.name])  # changed; unchanged, a repeated field keeps each value
                seen.add(part.name)
            chunks.append(b"--" + self.boundary + b"\r\n" + part.headers + b"\r\n\r\n" + data + b"\r\n")
        for name, value in fields.items():
            if name not in seen and all(p.name != name for p in self.parts):
                disposition = f'Content-Disposition: form-data; name="{name}"'.encode()
                chunks.append(
                    b"--" + self.boundary + b"\r\n" + disposition + b"\r\n\r\n" + _text(value) + b"\r\n"
                )
        return b"".join(chunks) + b"--" + self.boundary + b"--\r\n"


def _text(value: object) -> bytes:
    if isinstance(value, bool):
        return b"true" if value else b"false"
    return str(value).encode()


def parse_form(raw: bytes, content_type: str) -> Form:
    """Split a ``multipart/form-data`` body into its parts; 400 on anything malformed."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise BadRequest("this route takes multipart/form-data (the audio file and its form fields)")
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise BadRequest("multipart/form-data without a boundary")
    boundary = found.group(1) if found.group(1) is not None else found.group(2)
    if not _BCHARS.fullmatch(boundary):
        raise BadRequest("multipart/form-data: the boundary must be 1-70 of RFC 2046's characters")
    delimiter = b"--" + boundary.encode()
    # At most the parts allowed (and the text before and after): a body of delimiters alone
    # split whole was ~13x its size in small objects before the count was checked.
    pieces = raw.split(delimiter, _MAX_PARTS + 1)
    if len(pieces) == _MAX_PARTS + 2 and delimiter in pieces[-1]:
        raise BadRequest(f"more than {_MAX_PARTS} form parts")
    if len(pieces) < 3 or not pieces[-1].startswith(b"--"):
        raise BadRequest("malformed multipart body: no closing boundary")
    parts = []
    for piece in pieces[1:-1]:
        if not piece.startswith(b"\r\n") or not piece.endswith(b"\r\n"):
            raise BadRequest("malformed multipart body: a part is not delimited by CRLF")
        head, sep, data = piece[2:-2].partition(b"\r\n\r\n")
        if not sep:
            raise BadRequest("malformed multipart body: a part has no header end")
        name, is_file = _disposition(head)
        if not is_file and len(data) > _MAX_FIELD_BYTES:
            raise BadRequest(f"form field {quoted(name)} is too long")
        parts.append(_Part(head, name, data, is_file))
    return Form(boundary.encode(), tuple(parts))


def _disposition(head: bytes) -> tuple[str, bool]:
    """A part's field name and whether it is a file, from its one ``Content-Disposition`` header,
    read as the engines' form parsers read it. A ``name="…"`` or ``filename=`` elsewhere in the
    head is no name: matched anywhere, a crafted part showed the gateway one ``model`` (checked
    against the tenant's models) while the engine read another."""
    disposition = None
    for line in head.split(b"\r\n"):
        header, colon, value = line.partition(b":")
        if not colon or not header.strip() or header[:1] in b" \t":
            raise BadRequest("malformed multipart body: a part header is not 'Name: value'")
        if header.strip().lower() == b"content-disposition":
            if disposition is not None:
                raise BadRequest("malformed multipart body: a part has two Content-Disposition headers")
            disposition = value.strip()
    if disposition is None or disposition[:9].lower() != b"form-data":
        raise BadRequest("malformed multipart body: a part has no form-data Content-Disposition")
    if b"\\" in disposition:
        raise BadRequest("multipart body: a Content-Disposition with a backslash is refused (ambiguous)")
    params: dict[bytes, bytes] = {}
    at = 9
    while not _TRAILING.fullmatch(disposition, at):
        param = _PARAM.match(disposition, at)
        if param is None:
            raise BadRequest("malformed multipart body: a Content-Disposition parameter is not key=value")
        at = param.end()
        key = param.group(1).lower()
        if key.endswith(b"*"):  # RFC 5987 forms: python-multipart ignores them, and so does this
            continue
        if key in params:
            raise BadRequest(f"malformed multipart body: a part's {key.decode()!r} is given twice")
        params[key] = param.group(2) if param.group(2) is not None else param.group(3)
    name = params.get(b"name")
    if name is None:
        raise BadRequest("malformed multipart body: a part has no form-data name")
    return name.decode(errors="replace"), b"filename" in params
