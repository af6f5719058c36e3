"""Engine-exact tokens computed in the gateway, checked against real vLLM 0.32.

The tiny Llama's own ``tokenizer.json`` and chat template, loaded by
:class:`~gateway.prefix.local_tokenizer.LocalTokenizer`, must give exactly the tokens
vLLM computes: for ``/tokenize`` (chat and completion requests of every kind the local
path accepts) and for the chat completion itself (``return_token_ids``: the prompt the
engine ran). Then a gateway with ``tokenizer.source: local`` — no ``/tokenize`` at all —
must predict the engines' cached tokens under eviction as the ``/tokenize`` path does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.prefix.chat_template import Unsupported
from gateway.prefix.local_tokenizer import LocalTokenizer
from loadtest.realvllm.fleet import ensure_model
from tests.e2e_vllm.conftest import BLOCK_SIZE, NUM_BLOCKS, Fleet
from tests.e2e_vllm.helpers import MODEL
from tests.e2e_vllm.test_exact_kv_events import EXACT, ask, document, name_of, quiet, wait_live
from tests.prefix.conftest import GatewayProcessless, gateway_config
from tests.support.harness import metric_value

pytestmark = pytest.mark.slow


def _chats() -> list[dict[str, Any]]:
    doc = document(3)
    turn = [
        {"role": "system", "content": doc},
        {"role": "user", "content": "Which arches?"},
        {"role": "assistant", "content": "The stone ones, 漢字 é 🙂."},
        {"role": "user", "content": "And the piers?"},
    ]
    return [
        {"messages": [{"role": "user", "content": "hello"}]},
        {"messages": turn},
        {"messages": turn, "add_generation_prompt": False},
        {"messages": turn[:3], "add_generation_prompt": False, "continue_final_message": True},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        },
        {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "tags <s></s><|user|> inside", "name": "bob"}]},
        {"messages": [{"role": "user", "content": "  spaces\n\n\ttabs  "}], "add_special_tokens": True},
    ]


COMPLETIONS = [
    {"prompt": "a completion prompt"},
    {"prompt": document(5), "add_special_tokens": False},
    {"prompt": "<s>explicit bos</s>"},
]


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer(Path(ensure_model()))


async def engine_tokens(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[int]:
    async with http.post(url + "/tokenize", json={"model": MODEL, **body}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["tokens"]


async def test_local_tokens_equal_vllm_tokenize(fleet: Fleet, http, local: LocalTokenizer) -> None:
    url = fleet.urls[0]
    diffs = []
    for body in _chats():
        mine, theirs = local.chat_tokens(json.loads(json.dumps(body))), await engine_tokens(http, url, body)
        if mine != theirs:
            diffs.append((body, mine, theirs))
    for body in COMPLETIONS:
        mine, theirs = local.completion_tokens(body), await engine_tokens(http, url, body)
        if mine != theirs:
            diffs.append((body, mine, theirs))
    assert not diffs, diffs


async def test_local_tokens_equal_the_prompt_the_engine_ran(
    fleet: Fleet, http, local: LocalTokenizer
) -> None:
    """``/v1/chat/completions`` itself (``return_token_ids``): the tokens whose blocks it hashes."""
    url = fleet.urls[1]
    for body in _chats():
        if body.get("continue_final_message"):
            body = {**body, "add_generation_prompt": False}
        request = {"model": MODEL, "max_tokens": 1, "return_token_ids": True, **body}
        async with http.post(url + "/v1/chat/completions", json=request) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert local.chat_tokens(json.loads(json.dumps(body))) == answer["prompt_token_ids"], body


async def test_next_turns_from_the_previous_turns_tokens_equal_vllm_tokenize(fleet: Fleet, http) -> None:
    """The served model's chat markers are plain text: a next turn reuses the previous turn's
    tokens up to its last newline cut (``prefix_tokens.py``). Each turn of conversations whose
    messages hold newlines, blank lines, indents, apostrophes, digits and non-ASCII text equals
    the engine's own ``/tokenize``, and most turns did reuse."""
    tok = LocalTokenizer(Path(ensure_model()))
    rng = random.Random(21)
    pieces = [
        "arch",
        "stone's",
        "12",
        "\n",
        "\n\n",
        " \n",
        "\n  ",
        "\tx",
        "é",
        "漢字",
        "🙂",
        "<|user|>",
        "a\nb",
        "!",
    ]
    turns = 0
    for conversation in range(6):
        messages = [{"role": "system", "content": document(conversation)}]
        for _turn in range(5):
            words = " ".join(rng.choice(pieces) for _ in range(rng.randint(3, 40)))
            messages.append({"role": "user", "content": words})
            body = {"messages": messages}
            assert tok.chat_tokens(body) == await engine_tokens(http, fleet.urls[0], body), body
            turns += 1
            messages.append({"role": "assistant", "content": " ".join(rng.choice(pieces) for _ in range(9))})
    assert tok.prefix.hits >= turns - 6 - 3, (
        tok.prefix.hits
    )  # every turn after a conversation's first, nearly


async def test_what_vllm_refuses_the_local_path_refuses(fleet: Fleet, http, local: LocalTokenizer) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        "add_generation_prompt": True,
        "continue_final_message": True,
    }
    async with http.post(fleet.urls[0] + "/tokenize", json={"model": MODEL, **body}) as r:
        assert r.status == 400
    with pytest.raises(Unsupported):
        local.chat_tokens(body)


async def test_local_only_predictions_equal_the_engines_under_eviction(fleet: Fleet, http, stack) -> None:
    for url in fleet.urls:
        async with http.post(url + "/reset_prefix_cache") as r:
            assert r.status == 200
    prefix = {**EXACT, "kv_events": {**EXACT["kv_events"], "tokenizer": {
        "source": "local", "models": {MODEL: str(ensure_model())},
    }}}  # fmt: skip
    gw = GatewayProcessless(gateway_config(fleet.urls, prefix=prefix))
    await gw.start()
    stack.push_async_callback(gw.stop)
    await wait_live(gw, fleet.urls)
    rng = random.Random(41)
    docs = [document(d) for d in range(10)]
    conversations: list[list[dict[str, str]]] = []
    results = []
    for step in range(50):
        open_ = [c for c in conversations[-6:] if len(c) < 8]  # 3 turns at most: under max_model_len
        if len(open_) < 3 or rng.random() < 0.35:
            doc = docs[min(int(rng.paretovariate(1.0)) - 1, 9)]
            conversations.append([{"role": "system", "content": doc}])
            open_.append(conversations[-1])
        conversation = rng.choice(open_)
        words = " ".join(f"q{step}w{i}" for i in range(rng.randint(10, 60)))
        conversation.append({"role": "user", "content": f"Question {step}: {words}?"})
        await quiet(gw, fleet.urls)
        result = await ask(http, gw, conversation)
        conversation.append({"role": "assistant", "content": result["text"]})
        results.append(result)
    async with http.get(gw.url + "/metrics") as r:
        page = await r.text()
    exact = sum(1 for r in results if r["predicted"] == r["cached"])
    summary = {
        "requests": len(results),
        "exact": exact,
        "cached_tokens": sum(r["cached"] for r in results),
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "per_endpoint": {e: sum(1 for r in results if r["endpoint"] == e) for e in map(name_of, fleet.urls)},
        "misses": [(r["predicted"], r["cached"]) for r in results if r["predicted"] != r["cached"]],
        "local_ok": metric_value(page, "llm_gateway_prefix_local_tokenize_total", outcome="ok"),
    }
    print("\nlocal tokens on real vLLM:", json.dumps(summary))
    assert exact >= 0.98 * len(results), summary
    assert summary["cached_tokens"] > 0, summary
    assert summary["prompt_tokens"] > 2 * NUM_BLOCKS * BLOCK_SIZE * 2, summary  # 2× the fleet's KV: evictions
    assert summary["local_ok"] == len(results), summary
    assert not metric_value(page, "llm_gateway_prefix_tokenize_total", outcome="ok"), summary  # no /tokenize


async def test_auto_verifies_against_the_engine_then_stops_asking(fleet: Fleet, http, stack) -> None:
    prefix = {
        **EXACT,
        "kv_events": {**EXACT["kv_events"], "tokenizer": {"models": {MODEL: str(ensure_model())}}},
    }
    gw = GatewayProcessless(gateway_config(fleet.urls, prefix=prefix))
    await gw.start()
    stack.push_async_callback(gw.stop)
    await wait_live(gw, fleet.urls)
    conversation = [{"role": "system", "content": document(8)}]
    for turn in range(8):
        conversation.append({"role": "user", "content": f"Turn {turn}: and the arches?"})
        await quiet(gw, fleet.urls)
        result = await ask(http, gw, conversation)
        assert result["predicted"] == result["cached"], result
        conversation.append({"role": "assistant", "content": result["text"]})
    async with http.get(gw.url + "/metrics") as r:
        page = await r.text()
    local = "llm_gateway_prefix_local_tokenize_total"
    assert metric_value(page, local, outcome="verified") == 3  # real vLLM's /tokenize agreed 3 times
    assert not metric_value(page, local, outcome="mismatch")
    assert metric_value(page, "llm_gateway_prefix_tokenize_total", outcome="ok") == 3  # then no more asks
