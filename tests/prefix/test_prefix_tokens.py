"""A next turn encoded from the previous turn's cut equals a full encode — on real tokenizers
(the tiny Llama's with its chat markers as special tokens, and adversarial added tokens that
straddle cuts), over random multi-turn conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors, trainers

from gateway.prefix.local_tokenizer import LocalTokenizer
from gateway.prefix.prefix_tokens import PrefixTokens, newline_cuts_hold
from loadtest.realvllm.model import _WORDS, CHAT_TEMPLATE, build_tokenizer

PIECES = [*_WORDS, "<|user|>", "<|assistant", "|>", "<", "<s>", "</s>", " ", "\n", "é", "🙂", "  ", "12"]


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tiny-markers"), chat_markers=True)


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(PIECES) for _ in range(n))


def full(tokenizer: Tokenizer, value: str) -> list[int]:
    return tokenizer.encode(value, add_special_tokens=False).ids


def _conversations(tok: LocalTokenizer, rng: random.Random) -> None:
    """12 random six-turn conversations, each turn's tokens equal to a full encode."""
    for conversation in range(12):
        messages = [{"role": "system", "content": text(rng, rng.randint(100, 400))}]
        for turn in range(6):
            messages.append({"role": "user", "content": text(rng, rng.randint(1, 60))})
            body = {"messages": messages}
            assert tok.chat_tokens(body) == full(tok.tokenizer, tok.chat_text(body)), (conversation, turn)
            messages.append({"role": "assistant", "content": text(rng, rng.randint(0, 40))})


def test_next_turns_reuse_the_previous_tokens_and_equal_a_full_encode(marker_dir: Path) -> None:
    tok = LocalTokenizer(marker_dir)
    assert tok.prefix.enabled
    _conversations(tok, random.Random(5))
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


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer real vLLM serves the tiny Llama with: its chat markers are plain text."""
    return build_tokenizer(tmp_path_factory.mktemp("tiny-plain"))


def test_text_markers_are_cut_before_the_character_after_a_newline(plain_dir: Path) -> None:
    """Without special tokens in the template, a next turn still starts from the previous
    turn's tokens (cut after its last newline) and equals a full encode."""
    tok = LocalTokenizer(plain_dir)
    assert tok.prefix.enabled
    _conversations(tok, random.Random(11))
    assert tok.prefix.hits >= 12 * 4


# whitespace of every kind next to the newline, and what the split pattern treats specially
NEWLINE_PIECES = [*PIECES, "\n", " \n", "\n\n", "\n ", "\r\n", "\t", "\n\t", "'s", "'ll", "\u00a0",
                  "\u2028", "\u3000", "x\n", "9\n", ".\n", "\n.", "\n'", "\n9"]  # fmt: skip


def _whitespace_bpe(rng: random.Random) -> Tokenizer:
    """A byte-level BPE like the tiny Llama's, trained on text full of newlines and spaces, so
    that it merges whitespace runs ("\n\n", " \n", "\n ") into tokens of their own: a cut
    inside such a run then changes the tokens (the tiny Llama's corpus has no newline)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([_noisy(rng, 40) for _ in range(2000)], trainer=trainer)
    assert {"ĊĊ", "ĠĊ"} <= tok.get_vocab().keys()
    return tok


def _noisy(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(NEWLINE_PIECES) + rng.choice(["", " "]) for _ in range(n))


def _fuzz(tokenizer: Tokenizer, rng: random.Random, pairs: int = 400) -> PrefixTokens:
    """Old and new texts sharing everything up to a newline, random after it in each: the new
    text's tokens from the cache equal a full encode every time."""
    prefix = PrefixTokens(tokenizer, 64)
    for _ in range(pairs):
        base = _noisy(rng, rng.randint(150, 300)) + "\n"
        old = base + _noisy(rng, rng.randint(0, 6))
        assert prefix.encode(old) == full(tokenizer, old)
        new = base + _noisy(rng, rng.randint(0, 12))
        assert prefix.encode(new) == full(tokenizer, new), (repr(old[-40:]), repr(new[-60:]))
    return prefix


def test_newline_cuts_equal_a_full_encode_whatever_follows() -> None:
    """Spaces, other newlines, apostrophes, digits, non-ASCII after the newline, with a
    vocabulary that merges whitespace runs."""
    rng = random.Random(3)
    assert _fuzz(_whitespace_bpe(rng), rng).hits > 100


def test_trimmed_offsets_do_not_hide_a_newline(plain_dir: Path) -> None:
    """With ``trim_offsets`` a token "\\n<" (an added token that is normalized, so no cut of its
    own) reports its start after the newline: kept as a cut there, the cached ids lost the
    newline (found by review). The token before a cut must end at it too."""
    tokenizer = Tokenizer.from_file(str(plain_dir / "tokenizer.json"))
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    tokenizer.add_tokens(["\n<"])
    assert newline_cuts_hold(tokenizer)
    prefix = PrefixTokens(tokenizer, 64)
    base = "stone " * 90
    for old, new in ((base + "\n<", base + "\nx"), (base + "\nx\n<", base + "\nx\ny")):
        assert prefix.encode(old) == full(tokenizer, old)
        assert prefix.encode(new) == full(tokenizer, new)
    assert _fuzz(tokenizer, random.Random(4)).hits > 50


def _variant(directory: Path, change) -> Tokenizer:
    spec = json.loads(Tokenizer.from_file(str(directory / "tokenizer.json")).to_str())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


def test_no_newline_cuts_where_the_argument_does_not_hold(plain_dir: Path) -> None:
    """A normalizer, another pre-tokenizer, a prefix space, an added token that strips the
    whitespace before it: the newline is no cut there, and nothing is reused."""

    def normalizer(spec: dict) -> None:
        spec["normalizer"] = {"type": "NFKC"}

    def metaspace(spec: dict) -> None:
        spec["pre_tokenizer"] = {
            "type": "Metaspace",
            "replacement": "▁",
            "prepend_scheme": "first",
            "split": True,
        }

    def prefix_space(spec: dict) -> None:
        spec["pre_tokenizer"]["add_prefix_space"] = True

    variants = [_variant(plain_dir, c) for c in (normalizer, metaspace, prefix_space)]
    stripping = Tokenizer.from_file(str(plain_dir / "tokenizer.json"))
    stripping.add_special_tokens([AddedToken("<|user|>", special=True, lstrip=True)])
    for tokenizer in [*variants, stripping]:
        assert not newline_cuts_hold(tokenizer)
        prefix = PrefixTokens(tokenizer, 64)
        body = ("stone\nstone " * 100) + "\n<|user|>"
        for tail in ("a", "b c", "\n<|user|>d"):
            assert prefix.encode(body + tail) == full(tokenizer, body + tail)
        assert prefix.hits == 0


@pytest.mark.parametrize("kind", ["markers", "plain"])
def test_a_new_conversation_reuses_a_system_prompt_another_one_sent(
    kind: str, marker_dir: Path, plain_dir: Path
) -> None:
    """Agents and chat apps start every session with the same long system prompt: the first
    turn of a new conversation encodes only what follows it (the cut after the first message is
    kept beside the last one), and still equals a full encode."""
    tok = LocalTokenizer(marker_dir if kind == "markers" else plain_dir)
    rng = random.Random(21)
    system = {"role": "system", "content": text(rng, 400)}
    for first in ("what is in it?", "summarise the second part"):  # two sessions' first turns
        body = {"messages": [system, {"role": "user", "content": first}]}
        prepared = tok.prepare("chat", body)
        assert tok.finish(prepared) == full(tok.tokenizer, tok.chat_text(body))
    assert prepared.remaining < 100  # the second session: its question and the markers around it
    assert tok.prefix.hits == 1


def test_sessions_sharing_system_prompts_equal_a_full_encode(marker_dir: Path, plain_dir: Path) -> None:
    """Random conversations over three system prompts, turns interleaved across them."""
    for directory in (marker_dir, plain_dir):
        tok = LocalTokenizer(directory)
        rng = random.Random(23)
        systems = [text(rng, rng.randint(150, 400)) for _ in range(3)]
        open_: list[list[dict[str, str]]] = []
        for step in range(120):
            if len(open_) < 4 or rng.random() < 0.2:
                open_.append([{"role": "system", "content": rng.choice(systems)}])
            messages = rng.choice(open_)
            messages.append({"role": "user", "content": text(rng, rng.randint(1, 40))})
            body = {"messages": messages}
            assert tok.chat_tokens(body) == full(tok.tokenizer, tok.chat_text(body)), (directory, step)
            messages.append({"role": "assistant", "content": text(rng, rng.randint(0, 30))})
        assert tok.prefix.hits > 100


def test_no_newline_cut_where_an_added_token_starts(tmp_path: Path) -> None:
    """A system prompt ending in a newline, then a role marker that is an added token in one
    session (``<|user|>``) and plain text in the other (``<|tool|>``). Where the added token
    starts, the text's piece ends, so the BPE's split pattern keeps "\\n\\n" whole; plain text
    after it splits "\\n", "\\n": the cut kept from the first session must not serve the second
    (found by review, on a vocabulary that merges whitespace as real ones do)."""
    tokenizer = _whitespace_bpe(random.Random(3))
    specials = ("<s>", "</s>", "<|user|>")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = LocalTokenizer(tmp_path)
    for ending in ("\n", " \n", "\n\n"):
        system = {"role": "system", "content": "stone " * 100 + ending}
        for second in ({"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}):
            body = {"messages": [system, second]}
            assert tok.chat_tokens(body) == full(tok.tokenizer, tok.chat_text(body)), (ending, second)
