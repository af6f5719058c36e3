"""loadtest.token_reuse on the real tiny tokenizer: most of each prompt comes from the cache."""

from __future__ import annotations

from loadtest.token_reuse import replay


def test_most_of_the_workload_is_reused_not_encoded() -> None:
    result = replay(requests=200, in_flight=4)
    assert result["prompt_chars"] > 3000  # documents of 700 words as system prompts, and turns
    # next turns reuse their conversation's cut, new conversations their document's
    assert result["encoded_chars"] < 0.2 * result["prompt_chars"]
    assert result["hits"] > 150
