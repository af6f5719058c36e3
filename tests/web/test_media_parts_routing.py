"""An image (audio, file) in the prompt is part of its prefix: a new one starts a new prefix.

Review finding: every non-text part was a bare ``<image_url>`` placeholder, so requests with
different images and the same text hashed alike: the index predicted a cache hit for images
no replica had seen, and 30 such requests went to one replica. Real gateway, real upstreams.
"""

from __future__ import annotations

from collections import Counter

from gateway.request.apis import api_prompt
from gateway.request.prompt import canonical_chat_prompt
from gateway.request.types import ApiKind
from tests.support.harness import wait_until

QUESTION = "Describe everything you see in this photo, in detail, listing every object and its colour. " * 3


def _with_image(url: str) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": content}]


def test_equal_images_hash_alike_and_different_ones_do_not() -> None:
    first, again, other = (canonical_chat_prompt(_with_image(u)) for u in ("data:a", "data:a", "data:b"))
    assert first == again
    assert first != other  # old: equal
    for api, body in (
        (
            ApiKind.MESSAGES,
            {"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        ),
        (
            ApiKind.RESPONSES,
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        ),
    ):
        texts = set()
        for source in ("one", "two"):
            part = body["messages" if api is ApiKind.MESSAGES else "input"][0]["content"][0]
            part["source" if api is ApiKind.MESSAGES else "image_url"] = source
            texts.add(api_prompt(api, body))
        assert len(texts) == 2, (api, texts)


def test_an_image_hashes_alike_whatever_its_cache_breakpoint() -> None:
    """Anthropic clients move ``cache_control`` from block to block every turn: the same image
    with and without it is the same prefix (re-review: it was hashed in, and turn 2 diverged)."""
    source = {"type": "base64", "media_type": "image/png", "data": "iVBOR" * 1000}
    marked = {"type": "image", "source": source, "cache_control": {"type": "ephemeral"}}

    def prompt(image: dict) -> str:
        body = {
            "max_tokens": 1,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}],
        }
        return api_prompt(ApiKind.MESSAGES, body)

    assert prompt(marked) == prompt({"type": "image", "source": source})
    assert prompt(marked) != prompt({"type": "image", "source": {**source, "data": "other"}})


async def test_new_images_are_no_cache_hit_and_spread(start_upstream, start_gateway, http) -> None:
    upstreams = [await start_upstream(models=("m",)) for _ in range(3)]
    gw = await start_gateway([u.url for u in upstreams])  # the default policy: prefix-aware

    async def healthy() -> bool:
        return all(e.healthy and e.models for e in gw.state.registry)

    await wait_until(healthy, 5.0, "three replicas healthy")
    served, predicted = Counter(), []
    for i in range(30):
        body = {
            "model": "m",
            "messages": _with_image(f"data:image/png;base64,{'ABCD' * 50}{i:08d}"),
            "max_tokens": 4,
        }
        async with http.post(
            gw.url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}
        ) as resp:
            assert resp.status == 200, await resp.text()
            served[resp.headers["x-gateway-endpoint"]] += 1
            predicted.append(int(resp.headers["x-gateway-predicted-cached-tokens"]))
    assert predicted == [0] * 30, predicted  # old: a hit predicted for every image after the first
    assert max(served.values()) < 25, served  # old: all 30 on one replica
