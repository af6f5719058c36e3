"""The exact prefix index with LoRA adapters: simulators publishing KV events that name the
adapter (as vLLM's do), an in-process gateway; predictions equal what the engine reports for
an adapter's requests and for the base model's with the same prompt."""

from __future__ import annotations

from tests.prefix.conftest import gateway_config
from tests.prefix.test_exact_prefix_e2e import EXACT, settle, wait_live


async def _ask(http, gw, model: str, content: str) -> tuple[int, int]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
        predicted = int(r.headers["x-gateway-predicted-cached-tokens"])
    return predicted, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_adapter_blocks_are_predicted_for_the_adapter_only(start_sims, start_gateway, http):
    sims = await start_sims(1, kv_events=True, enable_lora=True, lora_modules=("sql",), max_loras=2)
    gw = await start_gateway(gateway_config([s.url for s in sims], prefix={"exact": "auto", **EXACT}))
    await wait_live(gw, sims)
    prompt = "select every column from the orders table where the total is large " * 6
    seen = []
    for model in ("sql", "sql", "sim-llama", "sim-llama", "sql"):
        seen.append(await _ask(http, gw, model, prompt))
        await settle(gw, sims)
    assert all(predicted == cached for predicted, cached in seen), seen
    # The adapter's second request hits its own blocks; the base model's first does not (with the
    # adapter's name missing from the events, the index took them for the base model's: 64
    # predicted, 0 cached).
    assert seen[1][1] > 0 and seen[2][1] == 0 and seen[3][1] > 0 and seen[4][1] > 0


async def test_an_adapters_first_request_does_not_match_the_base_models_blocks(
    start_sims, start_gateway, http
):
    """Before any BlockStored named the adapter, its request was hashed as a base-model one and
    matched the base model's blocks: predicted 64 cached tokens, the engine had 0 (review 2026-12-05).
    The replica's /v1/models says which names are adapters."""
    sims = await start_sims(1, kv_events=True, enable_lora=True, lora_modules=("sql",), max_loras=2)
    gw = await start_gateway(gateway_config([s.url for s in sims], prefix={"exact": "auto", **EXACT}))
    await wait_live(gw, sims)
    prompt = "select every column from the orders table where the total is large " * 6
    seen = []
    for model in ("sim-llama", "sim-llama", "sql"):
        seen.append(await _ask(http, gw, model, prompt))
        await settle(gw, sims)
    assert seen[1][1] > 0  # the base model's second turn hit its own blocks
    assert all(predicted == cached for predicted, cached in seen), seen
