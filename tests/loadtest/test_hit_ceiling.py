"""The offline hit ceiling: one never-evicting cache over the requests in the order sent."""

from __future__ import annotations

from loadtest.hit_ceiling import Sent, ceiling

B = 4  # tokens per block


def sent(conversation: int, tokens: list[int], completion: int = 0) -> Sent:
    return Sent(conversation, [], completion, tokens)


def test_first_request_misses_and_an_identical_prompt_hits_all_but_its_last_block():
    prompt = list(range(12))  # 3 blocks
    hits, queries = ceiling([sent(1, prompt), sent(2, prompt)], B)
    # The last token is always computed: 11 tokens may hit, i.e. 2 full blocks.
    assert (hits, queries) == (2 * B, 24)


def test_only_the_leading_run_of_blocks_counts():
    first = list(range(16))
    second = [*range(4), 99, 99, 99, 99, *range(8, 16)]  # block 2 differs: blocks 3-4 cannot hit
    assert ceiling([sent(1, first), sent(2, second)], B) == (B, 32)


def test_a_shared_document_hits_across_conversations_up_to_the_block_it_diverges_in():
    doc = list(range(100, 110))  # 2 full blocks + 2 tokens
    a, b = [*doc, 1, 2, 3, 4, 5], [*doc, 7, 8, 9]
    assert ceiling([sent(1, a), sent(2, b)], B) == (2 * B, len(a) + len(b))


def test_the_previous_turns_answer_is_cached_for_the_next_turn_only_up_to_its_length():
    turn1 = list(range(8))
    # turn 2 = turn 1 + its 6-token answer + a new question; the answer's blocks were generated
    turn2 = [*turn1, 50, 51, 52, 53, 54, 55, 60, 61, 62, 63, 64]
    hits, _ = ceiling([sent(1, turn1, completion=6), sent(1, turn2)], B)
    assert hits == (8 + 6) // B * B  # 3 blocks: prompt's 2 + 1 full block of the answer
    # Without the answer's completion tokens only the first prompt's blocks are there.
    assert ceiling([sent(1, turn1), sent(1, turn2)], B)[0] == 2 * B
    # Another conversation's answer is not this one's.
    assert ceiling([sent(1, turn1, completion=6), sent(2, turn2)], B)[0] == 2 * B


def test_nothing_sent_is_zero_over_zero():
    assert ceiling([], B) == (0, 0)
