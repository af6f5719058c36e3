"""Engine-exact tokens computed in the gateway, end to end: simulators tokenizing with the
tiny Llama's real ``tokenizer.json`` + chat template, KV events on, an in-process gateway
with ``prefix.kv_events.tokenizer``. Predictions must equal the engines' cached tokens with
no ``/tokenize`` after the verification; a tokenizer that disagrees with the engine is
caught and dropped; what the local path cannot do falls back, never fails a request."""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.realvllm.model import build_tokenizer
from loadtest.simulator import tokenizer as sim_tokenizer
from tests.prefix.conftest import gateway_config
from tests.prefix.test_exact_prefix_e2e import EXACT, MODEL, ask, metrics, settle, wait_live
from tests.support.harness import metric_value


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture
def real_sims(tok_dir: Path) -> Iterator[Path]:
    """The simulators in this process tokenize with ``tok_dir`` (back to the toy one after)."""
    sim_tokenizer.use(str(tok_dir))
    yield tok_dir
    sim_tokenizer.use(None)


def prefix(tokenizer: dict) -> dict:
    return {"exact": "auto", "kv_events": {**EXACT["kv_events"], "tokenizer": tokenizer}}


def count(text: str, outcome: str, **labels: str) -> float:
    return metric_value(text, "llm_gateway_prefix_local_tokenize_total", outcome=outcome, **labels) or 0.0


async def test_local_tokens_predict_the_engines_cache_without_tokenize(
    real_sims: Path, start_sims, start_gateway, http
) -> None:
    sims = await start_sims(2, kv_blocks=48, kv_events=True)  # 768 tokens each: evictions
    gw = await start_gateway(gateway_config([s.url for s in sims], prefix=prefix({"path": str(real_sims)})))
    await wait_live(gw, sims)
    rng = random.Random(3)
    docs = [f"Survey {d}. " + " ".join(f"arch {d}-{i} of stone" for i in range(30)) for d in range(4)]
    conversations: list[list[dict[str, str]]] = []
    results = []
    for turn in range(100):
        if len(conversations) < 6 or rng.random() < 0.2:
            conversations.append([{"role": "system", "content": rng.choice(docs)}])
        conversation = rng.choice(conversations)
        conversation.append({"role": "user", "content": f"turn {turn}: which piers {rng.randint(0, 99)}?"})
        await settle(gw, sims)
        _, predicted, cached, text = await ask(http, gw, conversation)
        conversation.append({"role": "assistant", "content": text})
        results.append((predicted, cached))
    # as tests/prefix/test_exact_prefix_e2e.py: a rare race between the answer's events and the next turn
    assert sum(1 for p, c in results if p == c) >= 0.98 * len(results), [r for r in results if r[0] != r[1]]
    assert sum(c for _, c in results) > 0  # the workload does hit the cache
    assert all(s.engine.kv.evictions > 0 for s in sims)  # and blocks were evicted
    page = await metrics(http, gw)
    assert count(page, "verified") == 3  # the first three compared with /tokenize ...
    assert count(page, "ok") == len(results)
    asked = metric_value(page, "llm_gateway_prefix_tokenize_total", outcome="ok")
    assert asked == 3  # ... and no round trip after them
    assert count(page, "mismatch") == 0


async def test_a_tokenizer_that_disagrees_with_the_engine_is_dropped(
    tok_dir: Path, start_sims, start_gateway, http
) -> None:
    sims = await start_sims(1, kv_blocks=256, kv_events=True)  # the toy tokenizer: other ids
    gw = await start_gateway(gateway_config([s.url for s in sims], prefix=prefix({"path": str(tok_dir)})))
    await wait_live(gw, sims)
    conversation = [{"role": "system", "content": "bridges of stone " * 20}]
    for turn in range(4):
        conversation.append({"role": "user", "content": f"turn {turn}"})
        await settle(gw, sims)
        _, predicted, cached, text = await ask(http, gw, conversation)
        assert predicted == cached  # the engine's own tokens were used throughout
        conversation.append({"role": "assistant", "content": text})
    page = await metrics(http, gw)
    assert count(page, "mismatch") == 1 and count(page, "verified") == 0
    assert count(page, "ok") == 1  # after the mismatch the local path is not even asked
    assert metric_value(page, "llm_gateway_prefix_tokenize_total", outcome="ok") == 4


async def test_local_only_falls_back_to_the_approximate_index_never_failing(
    real_sims: Path, start_sims, start_gateway, http
) -> None:
    sims = await start_sims(1, kv_blocks=256, kv_events=True)
    config = prefix({"source": "local", "models": {MODEL: str(real_sims)}, "max_prompt_chars": 5000})
    gw = await start_gateway(gateway_config([s.url for s in sims], prefix=config))
    await wait_live(gw, sims)
    bodies = [
        {"messages": [{"role": "user", "content": "kwargs"}], "chat_template_kwargs": {"tokenize": True}},
        {"messages": [{"role": "user", "content": "stone " * 2000}]},  # past max_prompt_chars
        {"messages": [{"role": "user", "content": "fine"}]},
    ]
    for body in bodies:
        body = {"model": MODEL, "max_tokens": 2, **body}
        async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
    page = await metrics(http, gw)
    assert count(page, "fallback", reason="chat_template_kwargs") == 1
    assert count(page, "fallback", reason="too_long") == 1
    assert count(page, "ok") == 1
    assert not metric_value(page, "llm_gateway_prefix_tokenize_total", outcome="ok")  # never /tokenize


async def test_auto_finds_the_model_in_the_hf_cache(
    real_sims: Path, start_sims, start_gateway, http, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tokenizer config at all: ``auto`` finds ``org/tiny`` in ``HF_HUB_CACHE`` (loaded in the
    background while the first request asks ``/tokenize``), verifies it, then uses it."""
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(real_sims, repo / "snapshots" / "rev1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    sims = await start_sims(1, kv_blocks=256, kv_events=True, model="org/tiny")
    gw = await start_gateway(gateway_config([s.url for s in sims], prefix={"exact": "auto", **EXACT}))
    await wait_live(gw, sims)
    conversation = [{"role": "system", "content": "arches of stone " * 30}]
    for turn in range(8):
        conversation.append({"role": "user", "content": f"turn {turn}"})
        await settle(gw, sims)
        body = {"model": "org/tiny", "messages": conversation, "max_tokens": 4}
        async with http.post(
            gw.url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}
        ) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
            assert (
                int(r.headers["x-gateway-predicted-cached-tokens"])
                == (answer["usage"]["prompt_tokens_details"]["cached_tokens"])
            )
        conversation.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        await asyncio.sleep(0.05 if turn == 0 else 0)  # the background load finishes
    page = await metrics(http, gw)
    assert count(page, "verified") == 3 and count(page, "mismatch") == 0
    assert count(page, "ok") >= 5  # every request after the load
    assert metric_value(page, "llm_gateway_prefix_tokenize_total", outcome="ok") <= 4  # 3 checks (+ the load)
