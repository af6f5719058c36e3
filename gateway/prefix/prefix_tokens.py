"""A conversation's next turn tokenized from where the previous one provably ends the same.

Encoding an 8k-token prompt costs ~10 ms here; turn N+1's text starts with turn N's. The
``tokenizers`` pipeline splits the text at added tokens *before* anything else (normalizer,
pre-tokenizer, model all run per piece), so after an added token ``t`` that is not
normalized and strips nothing, the tokens of what follows do not depend on what precedes
``t`` — provided no added token occurs across the cut in the new text (checked): then the
leftmost-longest matching before the cut makes the same choices as in the old text (the
old text's own straddling occurrences were not chosen there). The rest is encoded as ``t + rest``
(its pieces keep a non-zero offset, as Metaspace's ``prepend_scheme: first`` needs) and
``t``'s own id dropped. Only without special tokens (chat prompts): a post-processor adds
nothing then. Keys are the exact prefix text's hash; a miss is a full encode.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import xxhash
from tokenizers import Tokenizer

__all__ = ["Plan", "PrefixTokens"]

_MIN_REUSE_CHARS = 512  # a shorter reusable prefix saves less than the lookup costs


@dataclass(frozen=True, slots=True)
class Plan:
    """A cached cut ``text`` starts with: its ids (ending with the cut token) and where it ends."""

    hit: array[int] | None
    end: int
    cut: str

    def remaining(self, text: str) -> int:
        """Characters still to encode."""
        return len(text) - self.end + len(self.cut)


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
        self._cache: OrderedDict[bytes, array[int]] = OrderedDict()
        self._lock = threading.Lock()  # the tokenizer pool's threads share the cache
        self.hits = 0

    @property
    def enabled(self) -> bool:
        return self._pattern is not None

    def plan(self, text: str) -> Plan:
        """Where ``text`` can start from a cached cut (cheap: one regex pass and one hash pass)."""
        pattern = self._pattern
        if pattern is None:
            return Plan(None, 0, "")
        ends = [m.end() for m in pattern.finditer(text) if m.end() >= _MIN_REUSE_CHARS]
        digests = _prefix_digests(text, ends)
        for end, digest in zip(reversed(ends), reversed(digests), strict=True):
            with self._lock:
                hit = self._cache.get(digest)
            if hit is None:
                continue
            cut = self._cut_ids.get(hit[-1])
            if cut is None or not text.endswith(cut, 0, end) or self._straddled(text, end):
                continue
            return Plan(hit, end, cut)
        return Plan(None, 0, "")

    def encode(self, text: str, plan: Plan | None = None) -> list[int]:
        """``text``'s ids without special tokens, equal to a full encode."""
        if self._pattern is None:
            return self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        plan = plan if plan is not None else self.plan(text)
        hit, end, cut = plan.hit, plan.end, plan.cut
        if hit is not None:
            tail = self._tokenizer.encode_batch([cut + text[end:]], add_special_tokens=False)[0]
            if tail.ids and tail.ids[0] == hit[-1]:  # always, per the argument above
                self.hits += 1
                ids = hit.tolist() + tail.ids[1:]
                start, head = end - len(cut), len(hit) - 1
                self._remember(
                    text,
                    ids,
                    lambda i, s=start, t=tail, h=head: s + t.token_to_chars(i - h)[1] if i >= h else None,
                )
                return ids
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=False)[0]
        ids = encoding.ids
        self._remember(text, ids, lambda i: encoding.token_to_chars(i)[1])
        return ids

    def _straddled(self, text: str, end: int) -> bool:
        """Whether an added token occurs across ``end`` (starting before it, ending after)."""
        for word in self._added:
            if text.find(word, max(0, end - len(word) + 1), end + len(word) - 1) != -1:
                return True
        return False

    def _remember(self, text: str, ids: list[int], end_of: Callable[[int], int | None]) -> None:
        """Keep ``ids`` up to the last cut of ``text`` (its tokens there are final)."""
        cut_ids = self._cut_ids
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] not in cut_ids:
                continue
            end = end_of(i)
            if end is None or end < _MIN_REUSE_CHARS:
                return
            key = xxhash.xxh3_128_digest(text[:end].encode("utf-8", "surrogatepass"))
            kept = array("I", ids[: i + 1])
            with self._lock:
                self._cache[key] = kept
                self._cache.move_to_end(key)
                while len(self._cache) > self._entries:
                    self._cache.popitem(last=False)
            return


def _prefix_digests(text: str, ends: list[int]) -> list[bytes]:
    """The hash of ``text[:e]`` for every ``e`` in ``ends`` (ascending), in one pass."""
    hasher = xxhash.xxh3_128()
    out, start = [], 0
    for end in ends:
        hasher.update(text[start:end].encode("utf-8", "surrogatepass"))
        out.append(hasher.digest())
        start = end
    return out
