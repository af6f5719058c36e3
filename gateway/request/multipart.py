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

_BOUNDARY = re.compile(r'boundary="?([^";]{1,200})"?', re.IGNORECASE)
_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)
_FILENAME = re.compile(rb"\bfilename\*?=", re.IGNORECASE)
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
        return f"multipart/form-data; boundary={self.boundary.decode()}"

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
        """The body again, with text fields changed or added from ``fields`` (files as they came)."""
        seen: set[str] = set()
        chunks: list[bytes] = []
        for part in self.parts:
            data = part.data
            if not part.is_file and part.name in fields:
                data = _text(fields[part.name])
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
    boundary = found.group(1).encode()
    delimiter = b"--" + boundary
    pieces = raw.split(delimiter)
    if len(pieces) < 3 or not pieces[-1].startswith(b"--"):
        raise BadRequest("malformed multipart body: no closing boundary")
    parts = []
    for piece in pieces[1:-1]:
        if len(parts) >= _MAX_PARTS:
            raise BadRequest(f"more than {_MAX_PARTS} form parts")
        if not piece.startswith(b"\r\n") or not piece.endswith(b"\r\n"):
            raise BadRequest("malformed multipart body: a part is not delimited by CRLF")
        head, sep, data = piece[2:-2].partition(b"\r\n\r\n")
        if not sep:
            raise BadRequest("malformed multipart body: a part has no header end")
        name = _NAME.search(head)
        if name is None or b"form-data" not in head.lower():
            raise BadRequest("malformed multipart body: a part has no form-data name")
        is_file = _FILENAME.search(head) is not None
        if not is_file and len(data) > _MAX_FIELD_BYTES:
            raise BadRequest(f"form field {quoted(name.group(1).decode(errors='replace'))} is too long")
        parts.append(_Part(head, name.group(1).decode(errors="replace"), data, is_file))
    return Form(boundary, tuple(parts))
