"""A conversation's next turn tokenized from where the previous one provably ends the same.

Encoding an 8k-token prompt costs ~10 ms here; turn N+1's text starts with turn N's. Two
kinds of cut, each a place where the tokens after it cannot depend on the text before it:

- **after an added token** ``t`` that is not normalized and strips nothing. The ``tokenizers``
  pipeline splits the text at added tokens *before* anything else (normalizer, pre-tokenizer,
  model all run per piece), so provided no added token occurs across the cut in the new text
  (checked), the leftmost-longest matching before the cut makes the same choices as in the old
  text. The rest is encoded as ``t + rest`` (its pieces keep a non-zero offset, as Metaspace's
  ``prepend_scheme: first`` needs) and ``t``'s own id dropped.
- **before a printable ASCII character that follows a newline**, for tokenizers without a
  normalizer whose pre-tokenizer is byte-level with GPT-2's split pattern and no prefix space
  (models whose chat markers are plain text, as ``<|user|>`` is in the tiny Llama's template).
  No alternative of that pattern matches a newline together with a character that is not
  whitespace, so a pre-token always ends there; the pattern looks one character ahead at most,
  so the pre-tokens before the cut are the same whatever non-space character follows, and those
  after it are the pre-tokens of the rest alone. The model encodes each pre-token on its own.
  An added token that strips whitespace could take the newline: then there are no such cuts.

Only without special tokens (chat prompts): a post-processor adds nothing then. Keys are the
exact prefix text's hash; a miss is a full encode. Two cuts of a text are kept: its last one
(for the conversation's next turn) and, when the caller names where the first message ends,
the first cut after it (for every other conversation that starts with the same system prompt:
agents and chat apps send one long system prompt with every session).
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import xxhash
from tokenizers import Encoding, Tokenizer

__all__ = ["Plan", "PrefixTokens", "first_message_end", "newline_cuts_hold"]

_MIN_REUSE_CHARS = 512  # a shorter reusable prefix saves less than the lookup costs
# a text's last newline cuts looked up (8k short lines must not cost 8k hashes on the loop); a
# next turn that adds more lines than this after the previous turn's cut is encoded whole
_MAX_NEWLINE_CANDIDATES = 2048
# newline cuts tried, from the end, when a text's tokens are kept (each asks the encoding where
# a token starts: a scan of its tokens)
_MAX_NEWLINE_TRIES = 8
_NEWLINE_CUT = re.compile("\n(?=[!-~])")  # a cut at the match's end: before the printable character
# after the first message's end: how far (tokens, newline cuts) its cut is looked for
_FIRST_CUT_TOKENS = 64
_FIRST_CUT_TRIES = 4


@dataclass(frozen=True, slots=True)
class Plan:
    """A cached cut ``text`` starts with: its ids (ending at the cut) and where it ends.

    ``cut`` is the added token the ids end with (encoded again in front of the rest), or ""
    for a newline cut (the rest is encoded alone)."""

    hit: array[int] | None
    end: int
    cut: str

    def remaining(self, text: str) -> int:
        """Characters still to encode."""
        return len(text) - self.end + len(self.cut)


def _newline_cut_at(text: str, cut: int) -> bool:
    """Whether ``cut`` follows a newline and precedes a printable ASCII character."""
    return 0 < cut < len(text) and text[cut - 1] == "\n" and "!" <= text[cut] <= "~"


def newline_cuts_hold(tokenizer: Tokenizer) -> bool:
    """Whether a newline followed by a printable character is a cut for ``tokenizer`` (see above)."""
    spec: dict[str, Any] = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") is not None or pre.get("type") != "ByteLevel":
        return False
    if pre.get("add_prefix_space") or not pre.get("use_regex", True):
        return False
    if (spec.get("model") or {}).get("dropout") is not None:
        return False
    added = tokenizer.get_added_tokens_decoder().values()
    return not any(t.lstrip or t.rstrip or t.single_word for t in added)


class PrefixTokens:
    def __init__(self, tokenizer: Tokenizer, entries: int) -> None:
        self._tokenizer = tokenizer
        self._entries = entries
        added = tokenizer.get_added_tokens_decoder()
        self._added = sorted({t.content for t in added.values() if len(t.content) > 1}, key=len)
        cuts = {
            i: t.content
            for i, t in added.items()
            if t.content and not (t.normalized or t.lstrip or t.rstrip or t.single_word)
        }
        self._cut_ids = cuts
        words = sorted(set(cuts.values()), key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, words))) if words and entries else None
        self._newlines = bool(entries) and newline_cuts_hold(tokenizer)
        # an added token starting at a newline cut ends the text's piece there, and then GPT-2's
        # pattern takes "\n\n" or " \n" before it whole, which text after the cut splits: such a
        # place is no newline cut, in the kept text or in the new one (found by review)
        contents = sorted({t.content for t in added.values() if t.content}, key=len, reverse=True)
        self._added_start = re.compile("|".join(map(re.escape, contents))) if contents else None
        self._cache: OrderedDict[bytes, tuple[array[int], bool]] = OrderedDict()  # ids, newline cut
        self._lock = threading.Lock()  # the tokenizer pool's threads share the cache
        self.hits = 0

    @property
    def enabled(self) -> bool:
        return self._pattern is not None or self._newlines

    def _cut_ends(self, text: str) -> list[int]:
        """Every place ``text`` may be cut at, ascending."""
        ends = [m.end() for m in self._pattern.finditer(text)] if self._pattern is not None else []
        if self._newlines:
            newline_ends = [m.end() for m in _NEWLINE_CUT.finditer(text)]
            ends = sorted({*ends, *newline_ends[-_MAX_NEWLINE_CANDIDATES:]})
        return [e for e in ends if e >= _MIN_REUSE_CHARS]

    def plan(self, text: str) -> Plan:
        """Where ``text`` can start from a cached cut (cheap: one regex pass and one hash pass)."""
        if not self.enabled:
            return Plan(None, 0, "")
        ends = self._cut_ends(text)
        digests = _prefix_digests(text, ends)
        for end, digest in zip(reversed(ends), reversed(digests), strict=True):
            with self._lock:
                entry = self._cache.get(digest)
                if entry is not None:  # a system prompt's cut, read by every session, stays
                    self._cache.move_to_end(digest)
            if entry is None:
                continue
            hit, newline = entry
            if newline:
                if (
                    _newline_cut_at(text, end)
                    and not self._straddled(text, end)
                    and not self._added_at(text, end)
                ):
                    return Plan(hit, end, "")
                continue
            cut = self._cut_ids.get(hit[-1])
            if cut is None or not text.endswith(cut, 0, end) or self._straddled(text, end):
                continue
            return Plan(hit, end, cut)
        return Plan(None, 0, "")

    def encode(self, text: str, plan: Plan | None = None, first_end: int | None = None) -> list[int]:
        """``text``'s ids without special tokens, equal to a full encode.

        ``first_end``: where the first message's text ends in ``text`` (:func:`first_message_end`),
        so that the first cut after it is kept too."""
        if not self.enabled:
            return self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        plan = plan if plan is not None else self.plan(text)
        hit, end, cut = plan.hit, plan.end, plan.cut
        if hit is not None:
            tail = self._tokenizer.encode_batch([cut + text[end:]], add_special_tokens=False)[0]
            shared = 1 if cut else 0  # an added-token cut's token is encoded again, and dropped
            if not cut or (tail.ids and tail.ids[0] == hit[-1]):  # always, per the argument above
                self.hits += 1
                ids = hit.tolist() + tail.ids[shared:]
                start, head = end - len(cut), len(hit) - shared
                self._remember(text, ids, _TailOffsets(tail, start, head), first_end)
                return ids
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=False)[0]
        ids = encoding.ids
        self._remember(text, ids, _TailOffsets(encoding, 0, 0), first_end)
        return ids

    def _added_at(self, text: str, at: int) -> bool:
        """Whether an added token starts at char ``at`` of ``text``."""
        return self._added_start is not None and self._added_start.match(text, at) is not None

    def _straddled(self, text: str, end: int) -> bool:
        """Whether an added token occurs across ``end`` (starting before it, ending after)."""
        for word in self._added:
            if text.find(word, max(0, end - len(word) + 1), end + len(word) - 1) != -1:
                return True
        return False

    def _remember(
        self, text: str, ids: list[int], offsets: _TailOffsets, first_end: int | None = None
    ) -> None:
        """Keep ``ids`` up to the last cut of ``text`` (its tokens there are final), and up to
        the first cut after ``first_end``."""
        added = self._last_added_cut(ids, offsets)
        newline = self._last_newline_cut(text, offsets) if self._newlines else None
        if newline is not None and (added is None or newline[0] > added[0]):
            (end, count), is_newline = newline, True
        elif added is not None:
            (end, count), is_newline = added, False
        else:
            return
        self._keep(text, end, ids[:count], is_newline)
        if first_end is None or first_end >= end:
            return
        added = self._first_added_cut(ids, offsets, first_end, end)
        newline = self._first_newline_cut(text, offsets, first_end, end) if self._newlines else None
        if newline is not None and (added is None or newline[0] < added[0]):
            self._keep(text, newline[0], ids[: newline[1]], True)
        elif added is not None:
            self._keep(text, added[0], ids[: added[1]], False)

    def _keep(self, text: str, end: int, ids: list[int], is_newline: bool) -> None:
        key = xxhash.xxh3_128_digest(text[:end].encode("utf-8", "surrogatepass"))
        kept = array("I", ids)
        with self._lock:
            self._cache[key] = (kept, is_newline)
            self._cache.move_to_end(key)
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)

    def _last_added_cut(self, ids: list[int], offsets: _TailOffsets) -> tuple[int, int] | None:
        """(end char, tokens up to and with it) of the last added-token cut, or None."""
        cut_ids = self._cut_ids
        for i in range(len(ids) - 1, offsets.head - 1, -1):  # those before head: already cached
            if ids[i] not in cut_ids:
                continue
            end = offsets.end_of(i)
            return None if end is None or end < _MIN_REUSE_CHARS else (end, i + 1)
        return None

    def _first_added_cut(
        self, ids: list[int], offsets: _TailOffsets, after: int, before: int
    ) -> tuple[int, int] | None:
        """(end char, tokens up to and with it) of the first added-token cut ending after char
        ``after`` and before ``before``, within a few tokens of ``after``; or None."""
        start = offsets.token_at(after)
        if start is None:
            return None
        cut_ids = self._cut_ids
        for i in range(start, min(len(ids), start + _FIRST_CUT_TOKENS)):
            if ids[i] not in cut_ids:
                continue
            end = offsets.end_of(i)
            if end is None or end >= before:
                return None
            return (end, i + 1) if end >= _MIN_REUSE_CHARS else None
        return None

    def _first_newline_cut(
        self, text: str, offsets: _TailOffsets, after: int, before: int
    ) -> tuple[int, int] | None:
        """(cut char, tokens before it) of the first newline cut after char ``after`` (and
        before ``before``) where a token starts, or None."""
        tries = _FIRST_CUT_TRIES
        for match in _NEWLINE_CUT.finditer(text, after, before):
            cut = match.end()
            if cut < _MIN_REUSE_CHARS or self._added_at(text, cut):
                continue
            count = offsets.tokens_before(cut)
            if count is not None:
                return cut, count
            tries -= 1
            if not tries:
                return None
        return None

    def _last_newline_cut(self, text: str, offsets: _TailOffsets) -> tuple[int, int] | None:
        """(cut char, tokens before it) of the last newline cut where a token starts, or None."""
        end, tries = len(text) - 1, _MAX_NEWLINE_TRIES
        while tries and (end := text.rfind("\n", 0, end)) >= 0:
            cut = end + 1
            if cut < _MIN_REUSE_CHARS:
                return None
            if _newline_cut_at(text, cut) and not self._added_at(text, cut):
                tries -= 1
                count = offsets.tokens_before(cut)
                if count is not None:
                    return cut, count
        return None


class _TailOffsets:
    """Char offsets of ``ids`` when its tokens from ``head`` on are ``encoding``'s, which
    encoded the text from char ``start`` (the tokens before ``head`` came from the cache)."""

    __slots__ = ("encoding", "head", "start")

    def __init__(self, encoding: Encoding, start: int, head: int) -> None:
        self.encoding, self.start, self.head = encoding, start, head

    def end_of(self, index: int) -> int | None:
        if index < self.head:
            return None
        return self.start + self.encoding.token_to_chars(index - self.head)[1]

    def token_at(self, char: int) -> int | None:
        """The index in ``ids`` of the token covering ``char`` (None: in the cached part, or none)."""
        at = char - self.start
        if at < 0:
            return None
        token = self.encoding.char_to_token(at)
        return None if token is None else self.head + token

    def tokens_before(self, char: int) -> int | None:
        """How many tokens cover exactly ``text[:char]`` (None: no token boundary there).

        A token must start at ``char`` and the one before end there: a post-processor's
        ``trim_offsets`` moves a whitespace-led token's start past its whitespace, and only
        shrinks spans, so the two together still prove the boundary (tokens tile the text)."""
        at = char - self.start
        if at <= 0:
            return None
        encoding = self.encoding
        token = encoding.char_to_token(at)
        if (
            not token
            or encoding.token_to_chars(token)[0] != at
            or encoding.token_to_chars(token - 1)[1] != at
        ):
            return None
        return self.head + token


def _prefix_digests(text: str, ends: list[int]) -> list[bytes]:
    """The hash of ``text[:e]`` for every ``e`` in ``ends`` (ascending), in one pass."""
    hasher = xxhash.xxh3_128()
    out, start = [], 0
    for end in ends:
        hasher.update(text[start:end].encode("utf-8", "surrogatepass"))
        out.append(hasher.digest())
        start = end
    return out


def first_message_end(text: str, messages: list[Any]) -> int | None:
    """Where the first of several messages' text ends in the rendered ``text`` (None: not found,
    too short to be worth a cut, or one message only)."""
    if len(messages) < 2 or not isinstance(messages[0], dict):
        return None
    content = messages[0].get("content")
    if not isinstance(content, str) or len(content) < _MIN_REUSE_CHARS:
        return None
    at = text.find(content)
    return None if at < 0 else at + len(content)
