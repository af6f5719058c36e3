"""The file key store: tenants and hashed keys in one YAML file, hot-reloadable.

```yaml
tenants:
  acme:
    priority: standard            # critical | standard | sheddable
    models: [llama-3-8b]          # empty or missing: every model
    requests_per_minute: 600      # missing or 0: unlimited
    tokens_per_minute: 200000     # missing or 0: unlimited
    debug: false                  # may see the routing debug header
    slo_ttft_ms: 2000             # objectives when a request sends no x-slo-* header (optional)
keys:
  - sha256: 3f1c…                 # hex sha256 of the key (64 digits)
    tenant: acme
    name: ci-key                  # shown in logs instead of the key
```

A reload swaps the whole table at once, and only after the new file validated: a
broken edit leaves the previous keys serving and says, by key path, what is wrong.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.auth.keys import hash_key
from gateway.auth.tenant import TENANT_NAME_PATTERN, Tenant, TenantSpec
from gateway.config import format_validation_error
from gateway.config.yaml_file import safe_load_bounded

__all__ = ["FileKeyStore", "KeyFileError", "load_keys_file"]

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TENANT_NAME = re.compile(TENANT_NAME_PATTERN)


class KeyFileError(ValueError):
    """The keys file cannot be used; the message names the file and the offending key paths."""


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str
    tenant: str
    name: str = ""

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        value = value.strip().lower()
        if not _SHA256.match(value):
            # Never echo the value: it may be a raw key pasted into the wrong field.
            raise ValueError("must be the hex sha256 of the key (64 hex digits), not the key itself")
        return value


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: dict[str, TenantSpec]
    keys: list[KeyEntry] = Field(default_factory=list)

    @field_validator("keys", mode="before")
    @classmethod
    def _null_keys(cls, value: Any) -> Any:
        return [] if value is None else value

    @model_validator(mode="after")
    def _references(self) -> KeysFile:
        for name in self.tenants:
            if not _TENANT_NAME.match(name):
                raise ValueError(
                    f"tenants.{name}: tenant names use letters, digits and . _ : @ - (at most 128)"
                )
        seen: dict[str, int] = {}
        for index, entry in enumerate(self.keys):
            if entry.tenant not in self.tenants:
                raise ValueError(
                    f"keys.{index}.tenant: unknown tenant {entry.tenant!r} (defined: {sorted(self.tenants)})"
                )
            if entry.sha256 in seen:
                raise ValueError(f"keys.{index}.sha256: duplicate of keys.{seen[entry.sha256]}.sha256")
            seen[entry.sha256] = index
        return self


def load_keys_file(path: str | Path) -> dict[str, Tenant]:
    """Parse and validate the file: key hash → its tenant. Raises :class:`KeyFileError`."""
    try:
        loaded = safe_load_bounded(Path(path).read_text())
    except OSError as exc:
        raise KeyFileError(f"cannot read keys file {path}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: half a UTF-8 character
        raise KeyFileError(f"keys file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise KeyFileError(f"keys file {path}: top level must be a mapping with `tenants` and `keys`")
    try:
        parsed = KeysFile.model_validate(loaded)
    except ValidationError as exc:
        raise KeyFileError(f"invalid keys file {path}: {format_validation_error(exc)}") from None
    return {
        entry.sha256: parsed.tenants[entry.tenant].to_tenant(entry.tenant, entry.name)
        for entry in parsed.keys
    }


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


class FileKeyStore:
    """:class:`~gateway.auth.keys.KeyStore` over a YAML file; lookups are one dict access, no I/O."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._keys: dict[str, Tenant] = {}
        self._stamp: tuple[int, int, int] | None = None
        self.reload()  # an invalid file at start-up is fatal: raise

    def reload(self) -> int:
        """Re-read the file; on any error keep the keys loaded before, log and raise :class:`KeyFileError`."""
        stamp = _stamp(self.path)
        try:
            keys = load_keys_file(self.path)
        except KeyFileError as exc:
            self._stamp = stamp  # reload_if_changed: report a broken edit once, not on every poll
            log.error("%s; still serving the %d keys loaded before", exc, len(self._keys))
            raise
        self._keys, self._stamp = keys, stamp
        tenants = {t.name for t in keys.values()}
        log.info("loaded %d API keys for %d tenants from %s", len(keys), len(tenants), self.path)
        return len(keys)

    def reload_if_changed(self) -> bool:
        """Reload when the file's mtime, size or inode changed (for a polling watcher). True if reloaded."""
        if _stamp(self.path) == self._stamp:
            return False
        self.reload()
        return True

    def lookup_now(self, raw_key: str) -> Tenant | None:
        return self._keys.get(hash_key(raw_key))

    async def lookup(self, raw_key: str) -> Tenant | None:
        return self.lookup_now(raw_key)

    def tenants(self) -> dict[str, Tenant]:
        """Every tenant that has at least one key, by name."""
        return {t.name: t for t in self._keys.values()}

    def __len__(self) -> int:
        return len(self._keys)

    async def close(self) -> None:
        return None
