"""The gateway's own tokenizer: a real ``tokenizer.json`` (the tiny Llama's, trained here) and
chat templates rendered as vLLM 0.32 / transformers 5 render them; what it cannot reproduce
is refused with a reason, never guessed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer

from gateway.config import load_config
from gateway.config.kv_events import TokenizerConfig
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.prefix.chat_template import Unsupported, conversation, render
from gateway.prefix.local_tokenizer import LocalTokenizer, find_tokenizer_dir
from gateway.prefix.local_tokens import LocalTokens
from gateway.prefix.template_format import content_format
from gateway.prefix.token_cache import TokenCache
from gateway.prefix.turn_tokens import TurnTokens
from loadtest.realvllm.model import CHAT_TEMPLATE, build_tokenizer

# A template with the features real ones use: tools as JSON, content parts, tool calls,
# raise_exception, a custom kwarg, the developer role.
FANCY = (
    "{{ bos_token }}{% if tools %}<|system|>Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}{% if message['content'] is string and message['content'] == 'RAISE' %}"
    "{{ raise_exception('refused') }}{% endif %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "[call {{ call.function.name }} {{ call.function.arguments | tojson }}]{% endfor %}{% endif %}\n"
    "{% endfor %}{% if greeting is defined %}{{ greeting }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def with_template(base: Path, target: Path, template: str, jinja_file: bool = False) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(base / name, target / name)
    config = json.loads((base / "tokenizer_config.json").read_text())
    if jinja_file:
        (target / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def raw_encode(directory: Path, text: str, special: bool = False) -> list[int]:
    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=special).ids


def chat(*messages: tuple[str, Any], **body: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **body}


def test_a_multi_turn_chat_is_the_template_text_encoded_without_special_tokens(tiny_dir: Path) -> None:
    tok = LocalTokenizer(tiny_dir)
    body = chat(("system", "the cache " * 50), ("user", "q1"), ("assistant", "a1 é 漢字 🙂"), ("user", "q2"))
    expected = "<s><|system|>" + "the cache " * 50 + "\n<|user|>q1\n<|assistant|>a1 é 漢字 🙂\n<|user|>q2\n"
    assert tok.chat_text(body) == expected + "<|assistant|>"
    assert tok.chat_tokens(body) == raw_encode(tiny_dir, expected + "<|assistant|>")
    assert tok.chat_text({**body, "add_generation_prompt": False}) == expected
    # a next turn extends the previous one's tokens (the template appends messages)
    shorter = tok.chat_tokens(chat(("system", "the cache " * 50), ("user", "q1")))
    assert tok.chat_tokens(body)[: len(shorter)] == shorter


def test_template_options_render_as_vllm_renders_them(tiny_dir: Path, tmp_path: Path) -> None:
    tok = LocalTokenizer(with_template(tiny_dir, tmp_path / "fancy", FANCY))
    assert content_format(FANCY) == "openai"  # it loops over message content: parts, not strings
    assert content_format(CHAT_TEMPLATE) == "string"
    text = tok.chat_text(chat(("user", [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}])))
    assert text == "<s><|user|>onetwo<|assistant|>"  # trim_blocks: no newline after a tag
    calls = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]
    body = {
        "messages": [
            {"role": "user", "content": "find"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "found"},
        ],
        "tools": TOOLS,
    }
    text = tok.chat_text(body)
    tool_json = (
        '[{"type": "function", "function": {"name": "lookup", "description": null, '
        '"parameters": {"type": "object"}}}]'
    )  # vLLM's model_dump(): description present as null
    assert text.startswith("<s><|system|>Tools: " + tool_json + "\n")
    assert '<|assistant|>[call lookup {"q": "x"}]<|tool|>found' in text  # arguments parsed to an object
    prefill = chat(("user", "hi"), ("assistant", "The answer is"))
    text = tok.chat_text({**prefill, "add_generation_prompt": False, "continue_final_message": True})
    assert text == "<s><|user|>hi<|assistant|>The answer is"
    kwargs = tok.chat_text(chat(("user", "hi"), chat_template_kwargs={"greeting": "HELLO", "other": 1}))
    assert kwargs.endswith("HELLO<|assistant|>")
    dev = tok.chat_text(chat(("developer", "be brief"), ("user", "hi")))
    assert dev.startswith("<s><|system|>be brief<|user|>")  # no developer role in the template: system


def test_chat_template_jinja_file_wins_and_completions_keep_special_tokens(
    tiny_dir: Path, tmp_path: Path
) -> None:
    tok = LocalTokenizer(with_template(tiny_dir, tmp_path / "jinja", "[{{ messages[0]['content'] }}]", True))
    assert tok.chat_text(chat(("user", "x"))) == "[x]"
    assert tok.completion_tokens({"prompt": "a b c"}) == raw_encode(tiny_dir, "a b c", special=True)
    # special-token text inside content is the special token, as in the engine
    assert tok.chat_tokens(chat(("user", "<s>"))) == raw_encode(tiny_dir, "[<s>]")
    assert raw_encode(tiny_dir, "<s>") == [tok.tokenizer.token_to_id("<s>")]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (chat(("user", [{"type": "image_url", "image_url": {"url": "data:,"}}])), "content_part"),
        (chat(("user", "x"), chat_template="{{ 1 }}"), "engine_only_field"),
        (chat(("user", "x"), cache_salt="s"), "engine_only_field"),
        (chat(("user", "x"), chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
        (chat(("user", "x"), tools=[{"type": "function"}]), "tools"),
        (chat(("user", "x"), tools=TOOLS, tool_choice="none"), "tool_choice_none"),
        ({"messages": ["not a message"]}, "message"),
        ({"messages": []}, "message"),
        (
            chat(("user", "x"), add_generation_prompt=True, continue_final_message=True),
            "continue_final_message",
        ),
    ],
)
def test_what_the_local_path_cannot_reproduce_is_refused(
    tiny_dir: Path, tmp_path: Path, body, reason
) -> None:
    tok = LocalTokenizer(with_template(tiny_dir, tmp_path / "t", FANCY))
    with pytest.raises(Unsupported) as info:
        tok.chat_tokens(body)
    assert info.value.reason == reason


def test_a_broken_template_is_refused_and_huge_content_still_renders(tiny_dir: Path, tmp_path: Path) -> None:
    tok = LocalTokenizer(with_template(tiny_dir, tmp_path / "bad", "{% for m in messages %}{{ m.content "))
    with pytest.raises(Unsupported) as info:
        tok.chat_tokens(chat(("user", "x")))
    assert info.value.reason == "template"
    refusing = LocalTokenizer(with_template(tiny_dir, tmp_path / "raise", "{{ raise_exception('no') }}"))
    with pytest.raises(Unsupported) as info:
        refusing.chat_tokens(chat(("user", "x")))
    assert info.value.reason == "template_error"  # the engine answers 400 to it too
    with pytest.raises(Unsupported):
        render("{{ messages[5]['x'] + 1 }}", conversation([{"role": "u", "content": "x"}], "string"),
               special_tokens={}, kwargs={}, tools=None)  # fmt: skip
    big = LocalTokenizer(tiny_dir).chat_tokens(chat(("user", "stone " * 200_000)))
    assert len(big) >= 200_000  # 1.2 MB of content: encoded, no crash


def test_tokenizer_directories_come_from_config_or_the_hf_cache(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_dir, snap)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert find_tokenizer_dir("org/tiny", models={}, path=None, hf_cache=True) == snap
    assert find_tokenizer_dir("org/tiny", models={}, path=None, hf_cache=False) is None
    assert find_tokenizer_dir("org/other", models={}, path=None, hf_cache=True) is None
    assert find_tokenizer_dir("../etc", models={}, path=None, hf_cache=True) is None
    assert find_tokenizer_dir("m", models={"m": str(tiny_dir)}, path=None, hf_cache=True) == tiny_dir


def test_a_configured_directory_without_a_tokenizer_is_a_config_error(tiny_dir: Path, tmp_path: Path) -> None:
    def load(tokenizer: dict[str, Any]) -> Any:
        raw = {
            "endpoints": [{"url": "http://127.0.0.1:1"}],
            "prefix": {"kv_events": {"tokenizer": tokenizer}},
        }
        return load_config(overrides=raw, environ={})

    assert load({"path": str(tiny_dir)}).prefix.kv_events.tokenizer.path == str(tiny_dir)
    for bad in ({"path": str(tmp_path)}, {"models": {"m": str(tmp_path / "missing")}}, {"source": "guess"}):
        with pytest.raises(Exception, match="tokenizer"):
            load(bad)


class _Request:
    """What LocalTokens reads of an InferenceRequest."""

    def __init__(self, body: dict[str, Any], api: str = "chat", prompt_text: str | None = None) -> None:
        self.body, self.api, self.model = body, api, "m"
        self.raw_body = json.dumps(body).encode()
        self.prompt_text = json.dumps(body) if prompt_text is None else prompt_text


async def test_a_model_is_trusted_after_its_checks_and_dropped_at_a_mismatch(tiny_dir: Path) -> None:
    local = LocalTokens(
        TokenizerConfig(path=str(tiny_dir), verify_requests=2), KVEventMetrics(CollectorRegistry())
    )
    request = _Request(chat(("user", "hi")))
    tokens = await local.tokens(request)
    assert tokens == LocalTokenizer(tiny_dir).chat_tokens(request.body)
    assert not local.trusted(request)
    assert local.check("m", tokens, tokens) and not local.trusted(request)
    assert local.check("m", tokens, tokens) and local.trusted(request)
    assert not local.comparable(_Request({**request.body, "documents": []}))  # /tokenize renders it otherwise
    assert not local.check("m", tokens, [*tokens, 1]) and local.distrusted("m")
    assert await local.tokens(_Request({"prompt": "a b"}, api="completions")) == raw_encode(
        tiny_dir, "a b", True
    )
    local.close()


async def test_long_new_text_is_encoded_in_the_pool_and_short_on_the_loop(tiny_dir: Path) -> None:
    """``inline_chars`` splits the work: the same tokens either way, on the thread that the
    setting says (the pool's threads are named ``llmgw-tokenize``)."""
    import threading

    where: list[str] = []

    class Recording(LocalTokenizer):
        def finish(self, prepared: Any) -> list[int]:
            where.append(threading.current_thread().name)
            return super().finish(prepared)

    cases = [("word " * 1000, 16384, False), ("word " * 1000, 2048, True), ("word " * 1000, 0, True)]
    cases += [("語" * 5000, 16384, True), ("語" * 3000, 16384, False)]  # not ASCII: a quarter of it
    for text, inline_chars, pooled in cases:
        long_body = chat(("user", text))
        expected = LocalTokenizer(tiny_dir).chat_tokens(long_body)
        local = LocalTokens(
            TokenizerConfig(path=str(tiny_dir), source="local", inline_chars=inline_chars),
            KVEventMetrics(CollectorRegistry()),
        )
        local._by_dir = {d: Recording(tiny_dir) for d in local._by_dir}
        where.clear()
        assert await local.tokens(_Request(long_body)) == expected
        pooled_here = where[0].startswith("llmgw-tokenize")
        assert len(where) == 1 and pooled_here is pooled, (text[:9], inline_chars, where)
        local.close()


async def test_a_body_past_the_limit_is_not_rendered_whatever_its_prompt_text_says(tiny_dir: Path) -> None:
    """The prompt text leaves out tools and counts a message as a few characters: 13 MB of tools
    passed ``max_prompt_chars`` and were rendered and encoded for seconds (review, 2026-12-05)."""
    rendered: list[str] = []

    class Recording(LocalTokenizer):
        def prepare(self, api: Any, body: dict[str, Any]) -> Any:
            rendered.append(api)
            return super().prepare(api, body)

    local = LocalTokens(
        TokenizerConfig(path=str(tiny_dir), source="local", max_prompt_chars=10_000),
        KVEventMetrics(CollectorRegistry()),
    )
    local._by_dir = {d: Recording(tiny_dir) for d in local._by_dir}
    tool = {"type": "function", "function": {"name": "f", "description": "x" * 20_000, "parameters": {}}}
    huge_tools = {**chat(("user", "hi")), "tools": [tool]}
    many_messages = chat(*[("user", "a")] * 2_000)
    for body in (huge_tools, many_messages):
        assert await local.tokens(_Request(body, prompt_text="hi")) is None
    assert rendered == []
    assert await local.tokens(_Request(chat(("user", "hi")))) is not None  # within it: rendered
    assert rendered == ["chat"]
    local.close()


def test_the_token_cache_is_bounded_in_tokens_as_well_as_prompts() -> None:
    cache = TokenCache(entries=4, max_tokens=10)
    for key, length in ((b"a", 4), (b"b", 4), (b"c", 4)):  # 12 tokens: the oldest goes
        cache.put(key, list(range(length)))
    assert b"a" not in cache and b"b" in cache and b"c" in cache and cache.tokens == 8
    assert cache.get(b"b") is not None  # used: now the newest
    cache.put(b"d", [1, 2, 3])
    assert b"c" not in cache and cache.tokens == 7
    cache.put(b"huge", list(range(11)))  # larger than the whole budget: kept by nobody
    assert cache.tokens == 0 and b"huge" not in cache
    for n in range(6):  # and never more than four prompts
        cache.put(bytes([n]), [n])
    assert cache.tokens == 4


def test_the_turn_token_copy_is_bounded_in_tokens_too() -> None:
    """With ``reuse_turn_tokens`` each prompt's tokens are kept a second time, by conversation:
    that copy was bounded by count alone (found by review, 2026-12-05)."""
    turns = TurnTokens(entries=4, max_tokens=10)
    for n in range(3):
        body = chat(("user", f"conversation {n}"))
        turns.store(_Request(body, prompt_text=f"conversation {n}"), body, list(range(4)))  # type: ignore[arg-type]
    assert turns.tokens == 8  # the oldest of three 4-token prompts went
