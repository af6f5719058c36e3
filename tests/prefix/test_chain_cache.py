"""The hash-chain cache returns exactly ``block_hashes``, reuses what a prompt shares with a
recent one, and stays within its bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.prefix.chain_cache import HashChainCache
from gateway.prefix.hashing import block_hashes

SYSTEM = "You are a coding agent. Tools: read_file, write_file, run. " * 40  # ~2.4 KB


def conversation(session: int, turns: int) -> str:
    return SYSTEM + "".join(
        f"[user] s{session} question {t} é✓ " * 12 + f"[assistant] answer {t} " * 9 for t in range(turns)
    )


def _unique_size(cache: HashChainCache) -> int:
    return sum({id(c): c.size for c in cache._entries.values()}.values())


def test_the_next_turn_hashes_only_what_is_new() -> None:
    cache = HashChainCache()
    first = conversation(1, 10)
    assert cache.block_hashes("m", first, 64, session="s1") == block_hashes("m", first, 64)
    hashed = cache.hashed_blocks
    following = conversation(1, 11)
    assert cache.block_hashes("m", following, 64, session="s1") == block_hashes("m", following, 64)
    new_blocks = cache.hashed_blocks - hashed
    assert new_blocks < (len(following) - len(first)) // 64 + 16  # the new turn, and < 16 blocks before it
    assert cache.reused_blocks >= len(first.encode()) // 64 - 16


def test_without_a_session_a_conversation_still_finds_its_own_previous_turn() -> None:
    """Eight conversations with one system prompt, interleaved, no session id: each turn reuses
    its own conversation's previous turn (found by a window past the shared start), not only
    the system prompt that all of them share."""
    cache = HashChainCache()
    for turn in range(1, 8):
        for session in range(8):
            hashed = cache.hashed_blocks
            prompt, previous = conversation(session, turn + 1), conversation(session, turn)
            assert cache.block_hashes("m", prompt, 64) == block_hashes("m", prompt, 64)
            if turn > 1:
                new_blocks = (len(prompt.encode()) - len(previous.encode())) // 64
                assert cache.hashed_blocks - hashed <= new_blocks + 17, (turn, session)


def test_another_session_reuses_the_shared_system_prompt_and_not_more() -> None:
    cache = HashChainCache()
    cache.block_hashes("m", conversation(1, 6), 64, session="s1")
    reused = cache.reused_blocks
    other = conversation(2, 6)
    assert cache.block_hashes("m", other, 64, session="s2") == block_hashes("m", other, 64)
    assert len(SYSTEM) // 64 - 16 <= cache.reused_blocks - reused <= len(SYSTEM) // 64 + 1


def test_model_block_size_and_cap_are_part_of_the_chain() -> None:
    cache = HashChainCache()
    prompt = conversation(3, 8)
    cache.block_hashes("m", prompt, 64)
    assert cache.block_hashes("other", prompt, 64) == block_hashes("other", prompt, 64)
    assert cache.block_hashes("m", prompt, 32) == block_hashes("m", prompt, 32)
    assert cache.block_hashes("m", prompt, 64, max_blocks=20) == block_hashes("m", prompt, 64, 20)
    assert cache.block_hashes("m", prompt + " more", 64, max_blocks=20) == block_hashes("m", prompt, 64, 20)


def test_bytes_and_entries_stay_bounded_and_counted() -> None:
    cache = HashChainCache(max_bytes=300_000, max_entries=6)
    for session in range(40):
        cache.block_hashes("m", conversation(session, 3 + session % 5), 64, session=f"s{session}")
        assert cache.size_bytes == _unique_size(cache) <= 300_000
        assert len(cache) <= 6
    huge = conversation(99, 400)  # larger than the whole bound: answered, not kept
    assert cache.block_hashes("m", huge, 64) == block_hashes("m", huge, 64)
    assert cache.size_bytes == _unique_size(cache) <= 300_000
    off = HashChainCache(max_bytes=0)
    assert off.block_hashes("m", huge, 64) == block_hashes("m", huge, 64) and len(off) == 0


_PIECES = st.sampled_from(
    [SYSTEM, "[user] hi ", "[assistant] ok ", "é✓\U0001f600 ", "x" * 700, "\ud800 lone "]
)


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.lists(_PIECES, min_size=0, max_size=12),
            st.sampled_from(["m", "n"]),
            st.sampled_from([8, 64]),
            st.sampled_from([None, 3, 100]),
            st.sampled_from([None, "a", "b"]),
        ),
        min_size=1,
        max_size=12,
    ),
    max_bytes=st.sampled_from([0, 20_000, 64 << 20]),
)
def test_always_exactly_block_hashes(calls, max_bytes: int) -> None:
    """Any sequence of prompts (extending, diverging, shrinking, other models, sessions and
    block sizes) gets exactly the uncached chain."""
    cache = HashChainCache(max_bytes=max_bytes, max_entries=4)
    for pieces, model, block_bytes, max_blocks, session in calls:
        prompt = "".join(pieces)
        got = cache.block_hashes(model, prompt, block_bytes, max_blocks, session)
        assert got == block_hashes(model, prompt, block_bytes, max_blocks)
        assert cache.size_bytes == _unique_size(cache) <= max(max_bytes, 0)
