"""Bounded YAML (gateway/config/yaml_file.py): aliases expanded are counted without expanding them."""

from __future__ import annotations

import time

import pytest

from gateway.config.yaml_file import YamlTooLarge, safe_load_bounded


def _bomb(levels: int) -> str:
    node = "&a0 [" + ",".join(["lol"] * 10) + "]"
    for i in range(1, levels):
        node = f"&a{i} [" + node + "," + ",".join([f"*a{i - 1}"] * 9) + "]"
    return "x: " + node


def test_an_ordinary_document_with_aliases_loads_as_yaml_does() -> None:
    text = "base: &b {port: 1, labels: {a: 1}}\none: *b\ntwo: [*b, *b]\n"
    assert safe_load_bounded(text) == {
        "base": {"port": 1, "labels": {"a": 1}},
        "one": {"port": 1, "labels": {"a": 1}},
        "two": [{"port": 1, "labels": {"a": 1}}] * 2,
    }


def test_a_billion_laughs_is_refused_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(YamlTooLarge, match="expands to more than"):
        safe_load_bounded(_bomb(9))  # 10**9 values in a 600-byte document
    assert time.monotonic() - started < 1.0


def test_the_bound_counts_what_expanding_would_make() -> None:
    safe_load_bounded(_bomb(4), max_values=12_000)  # ~11k values expanded
    with pytest.raises(YamlTooLarge):
        safe_load_bounded(_bomb(4), max_values=5_000)


def test_a_document_that_contains_itself_is_refused() -> None:
    with pytest.raises(YamlTooLarge, match="contains itself"):
        safe_load_bounded("a: &x [1, *x]\n")


def test_it_is_a_value_error_so_config_and_keys_loaders_reject_it() -> None:
    assert issubclass(YamlTooLarge, ValueError)
