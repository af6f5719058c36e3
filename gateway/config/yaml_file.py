"""YAML for files an operator (or whoever can write them) hands the gateway: bounded in size
once aliases are expanded.

PyYAML builds an alias as a shared reference, so a file under 1 KB can hold 10**9 values
("billion laughs") or a structure that contains itself. Loading costs nothing, but whatever
walks the values afterwards (validation, an error message's ``repr``) expands them: a reload
of such a file printed a 72 MB rejection, and two more levels would take the process's
memory. The expanded size is computed per shared node once, so checking it is as cheap as
the file is small.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["MAX_VALUES", "YamlTooLarge", "safe_load_bounded"]

MAX_VALUES = 1_000_000  # expanded scalars, lists and mappings; a 100k-key keys file is ~600k


class YamlTooLarge(ValueError):
    """The document expands past :data:`MAX_VALUES`, or contains itself."""


def safe_load_bounded(text: str, max_values: int = MAX_VALUES) -> Any:
    """``yaml.safe_load``, refused when its aliases expand past ``max_values`` values."""
    loaded = yaml.safe_load(text)
    _expanded_size(loaded, {}, set(), max_values)
    return loaded


def _expanded_size(value: Any, sizes: dict[int, int], open_ids: set[int], limit: int) -> int:
    if not isinstance(value, list | dict):
        return 1
    key = id(value)
    known = sizes.get(key)
    if known is not None:
        return known
    if key in open_ids:
        raise YamlTooLarge("the document contains itself (a recursive alias)")
    open_ids.add(key)
    children = value.items() if isinstance(value, dict) else ((None, v) for v in value)
    total = 1
    for name, child in children:
        total += (0 if name is None else 1) + _expanded_size(child, sizes, open_ids, limit)
        if total > limit:
            raise YamlTooLarge(f"the document expands to more than {limit:,} values (YAML aliases?)")
    open_ids.discard(key)
    sizes[key] = total
    return total
