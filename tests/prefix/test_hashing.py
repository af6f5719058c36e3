"""Chained block hashes: prefix extension, model separation, block boundaries, unicode, determinism."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.prefix.hashing import DEFAULT_BLOCK_BYTES, block_hashes
from gateway.request.prompt import canonical_chat_prompt

B = DEFAULT_BLOCK_BYTES
SYSTEM = "You are a meticulous assistant. Answer in full sentences and cite the sources you use. " * 3


def _turns(n: int) -> list[list[dict[str, str]]]:
    """The message lists of turns 1..n of one conversation."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for i in range(n):
        messages = [*messages, {"role": "user", "content": f"Question {i}: what is {i} squared, and why?"}]
        turns.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"{i} squared is {i * i} because ..."}]
    return turns


def test_multi_turn_prompt_extends_and_hashes_extend():
    turns = _turns(5)
    prompts = [canonical_chat_prompt(t) for t in turns]
    for previous, current in itertools.pairwise(prompts):
        assert current.startswith(previous)
        assert len(current.encode()) > len(previous.encode())
        h_prev = block_hashes("m", previous)
        h_cur = block_hashes("m", current)
        full_prev = len(previous.encode()) // B
        assert len(h_prev) == full_prev > 0
        assert h_cur[:full_prev] == h_prev
        assert len(h_cur) >= len(h_prev)
        # every block after the shared part is new (chained: a hash depends on all bytes before it)
        assert not set(h_cur[full_prev:]) & set(h_prev)


def test_diverging_suffix_shares_only_full_common_blocks():
    head = "x" * (3 * B + 10)  # 3 full blocks + 10 bytes in common
    a = block_hashes("m", head + "A" * (2 * B))
    b = block_hashes("m", head + "B" * (2 * B))
    assert a[:3] == b[:3]
    assert all(x != y for x, y in zip(a[3:], b[3:], strict=True))


def test_model_separates_hashes():
    text = SYSTEM * 4
    a = block_hashes("llama-3.1-8b", text)
    b = block_hashes("llama-3.1-70b", text)
    assert len(a) == len(b) > 0
    assert not set(a) & set(b)
    # a model name that is a prefix of another, or the separator position, must not collide
    assert not set(block_hashes("m", "x" + text)) & set(block_hashes("mx", text))


@pytest.mark.parametrize("block", [8, 16, 64, 256])
@pytest.mark.parametrize("k", [1, 2, 7])
def test_block_boundaries(block: int, k: int):
    exact = "a" * (k * block)
    assert len(block_hashes("m", exact, block)) == k
    assert len(block_hashes("m", exact[:-1], block)) == k - 1
    plus = block_hashes("m", exact + "b" * (block - 1), block)
    assert plus == block_hashes("m", exact, block)  # trailing partial block is not indexed


@pytest.mark.parametrize("text", ["", "a", "x" * (B - 1)])
def test_shorter_than_a_block_has_no_hashes(text: str):
    assert block_hashes("m", text) == []


def test_last_partial_block_not_indexed():
    base = "q" * (2 * B)
    h = block_hashes("m", base)
    for extra in range(1, B):
        assert block_hashes("m", base + "z" * extra) == h
    assert len(block_hashes("m", base + "z" * B)) == 3


def test_blocks_cut_on_utf8_bytes_not_characters():
    # 'é' is 2 bytes, '€' 3, '😀' 4: block counts follow the byte length.
    for ch in ("é", "€", "😀"):
        n_bytes = len(ch.encode())
        text = ch * (B * 3)
        assert len(block_hashes("m", text)) == (len(text) * n_bytes) // B


def test_unicode_prefixes_and_distinct_text():
    head = "日本語のシステムプロンプト。絵文字も使う 🚀🧪👩‍💻 " * 8
    a = block_hashes("m", head + "最初の質問？")
    b = block_hashes("m", head + "二番目の質問！")
    full = len(head.encode()) // B
    assert a[:full] == b[:full] and full > 0
    # same characters in another normal form are different bytes, so different hashes
    assert block_hashes("m", "é" * B) != block_hashes("m", "e\u0301" * B)
    # one flipped emoji in the first block changes every block after it
    c = block_hashes("m", head.replace("🚀", "🛸", 1) + "最初の質問？")
    assert not set(a) & set(c)


def test_json_escaped_surrogates():
    # A JSON surrogate pair decodes to the real character: same bytes, same hashes.
    paired = json.loads('"\\ud83d\\ude00"') * 40
    assert paired == "😀" * 40
    assert block_hashes("m", paired) == block_hashes("m", "😀" * 40)
    # A lone surrogate (valid JSON, invalid UTF-8) must not crash hashing, and stays deterministic.
    lone = json.loads('"' + "abc\\ud800def" * 20 + '"')
    prompt = canonical_chat_prompt([{"role": "user", "content": lone}])
    assert block_hashes("m", prompt) == block_hashes("m", prompt)
    assert len(block_hashes("m", prompt)) == len(prompt.encode("utf-8", "surrogatepass")) // B


def test_hashes_are_64_bit_ints_and_mostly_distinct():
    h = block_hashes("m", "".join(f"line {i} of a long document\n" for i in range(400)))
    assert all(isinstance(x, int) and 0 <= x < 2**64 for x in h)
    assert len(set(h)) == len(h)


def test_same_in_a_separate_process():
    cases = [
        ("sim-llama", canonical_chat_prompt(_turns(3)[-1]), 64),
        ("m", "😀 emoji ünïcödé 中文 " * 20, 16),
        ("other/model:v2", "plain ascii text " * 30, 128),
    ]
    script = (
        "import json, sys\n"
        "from gateway.prefix.hashing import block_hashes\n"
        "cases = json.loads(sys.stdin.read())\n"
        "print(json.dumps([block_hashes(m, p, b) for m, p, b in cases]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    remote = json.loads(out.stdout)
    local = [block_hashes(m, p, b) for m, p, b in cases]
    assert all(local)
    assert remote == local
