"""A next turn encoded from the previous turn's cut equals a full encode — on real tokenizers
(the tiny Llama's with its chat markers as special tokens, and adversarial added tokens that
straddle cuts), over random multi-turn conversations."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from gateway.prefix.local_tokenizer import LocalTokenizer
from gateway.prefix.prefix_tokens import PrefixTokens
from loadtest.realvllm.model import _WORDS, build_tokenizer

PIECES = [*_WORDS, "<|user|>", "<|assistant", "|>", "<", "<s>", "</s>", " ", "\n", "é", "🙂", "  ", "12"]


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tiny-markers"), chat_markers=True)


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(PIECES) for _ in range(n))


def full(tokenizer: Tokenizer, value: str) -> list[int]:
    return tokenizer.encode(value, add_special_tokens=False).ids


def test_next_turns_reuse_the_previous_tokens_and_equal_a_full_encode(marker_dir: Path) -> None:
    tok = LocalTokenizer(marker_dir)
    assert tok.prefix.enabled
    rng = random.Random(5)
    for conversation in range(12):
        messages = [{"role": "system", "content": text(rng, rng.randint(100, 400))}]
        for turn in range(6):
            messages.append({"role": "user", "content": text(rng, rng.randint(1, 60))})
            body = {"messages": messages}
            assert tok.chat_tokens(body) == full(tok.tokenizer, tok.chat_text(body)), (conversation, turn)
            messages.append({"role": "assistant", "content": text(rng, rng.randint(0, 40))})
    assert tok.prefix.hits >= 12 * 4  # nearly every next turn started from the previous one's cut


def test_added_tokens_across_a_cut_are_not_reused_wrongly(marker_dir: Path) -> None:
    """``<|user|>`` and longer tokens around it (``<|user|>!!``; ``e<|user|>!``, which starts
    before it): a next text where one of them occurs across the old cut must not reuse it."""
    tokenizer = Tokenizer.from_file(str(marker_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|user|>!!", "e<|user|>!")]
    )
    tokenizer.add_tokens([AddedToken("ser|>x", normalized=True)])
    prefix = PrefixTokens(tokenizer, 64)
    rng = random.Random(9)
    for _ in range(300):
        base = text(rng, rng.randint(150, 300)) + rng.choice(["e", " "]) + "<|user|>"
        old = base + rng.choice(["", "!", "a b", "x"]) + text(rng, rng.randint(0, 5))
        assert prefix.encode(old) == full(tokenizer, old)
        new = base + rng.choice(["!!", "!! more", "! x", "<|user|>!!", "", "ser|>x"]) + text(rng, 8)
        assert prefix.encode(new) == full(tokenizer, new), new[-40:]
    assert prefix.hits > 0


def test_without_special_tokens_in_the_text_nothing_is_cached(tmp_path: Path) -> None:
    tok = LocalTokenizer(build_tokenizer(tmp_path / "plain"))  # only <s> is special: no cut worth it
    body = {"messages": [{"role": "user", "content": "stone " * 500}]}
    assert tok.chat_tokens(body) == tok.chat_tokens(body) == full(tok.tokenizer, tok.chat_text(body))
    assert tok.prefix.hits == 0
