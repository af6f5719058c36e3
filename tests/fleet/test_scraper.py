"""Engine /metrics parsing (vLLM, legacy vLLM, SGLang, garbage) and staleness of scraped load."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.fleet.endpoint import EngineKind
from gateway.fleet.scraper import ScrapedLoad, parse_engine_metrics
from tests.support.harness import debug_endpoints, gateway_metrics, metric_value, wait_until
from tests.support.upstreams import vllm_metrics

SAMPLE = (Path(__file__).resolve().parents[1] / "data" / "vllm-0.32-cpu-metrics-sample.txt").read_text()
EMPTY = ScrapedLoad()


def test_real_vllm_scrape():
    load = parse_engine_metrics(SAMPLE, EngineKind.VLLM)
    assert load.waiting == 0.0
    assert load.running == 0.0
    assert load.kv_usage == 0.0
    assert load.block_size == 32
    assert load.num_blocks == 512
    assert load.restart_marker == 466578.0  # the _total sample, not _created


def test_real_vllm_scrape_with_load():
    text = (
        SAMPLE.replace('vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 0.0', "X1")
        .replace('vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0', "X2")
        .replace('vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0', "X3")
    )
    assert text.count("X") >= 3
    text = (
        text.replace("X1", 'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 7.0')
        .replace("X2", 'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0')
        .replace("X3", 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.625')
    )
    load = parse_engine_metrics(text, EngineKind.VLLM)
    assert (load.waiting, load.running, load.kv_usage) == (7.0, 3.0, 0.625)
    # waiting_by_reason shares the prefix but is a different family and must not be summed in.
    assert "vllm:num_requests_waiting_by_reason" in text


def test_legacy_gpu_cache_usage_name():
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.42\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 2.0\n'
    )
    load = parse_engine_metrics(text, EngineKind.VLLM)
    assert load.kv_usage == pytest.approx(0.42)
    assert load.waiting == 2.0


def test_current_kv_name_wins_over_legacy():
    text = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n"
    assert parse_engine_metrics(text, EngineKind.VLLM).kv_usage == pytest.approx(0.1)


def test_several_engines_sum_queues_and_take_max_kv():
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0"} 2\n'
        'vllm:num_requests_waiting{engine="1"} 5\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 1\n'
        'vllm:num_requests_running{engine="1"} 4\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0"} 0.3\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.8\n'
    )
    load = parse_engine_metrics(text, EngineKind.VLLM)
    assert load.waiting == 7.0
    assert load.running == 5.0
    assert load.kv_usage == pytest.approx(0.8)


def test_sglang_names():
    text = (
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{model_name="m"} 4\n'
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m"} 6\n'
        "# TYPE sglang:token_usage gauge\n"
        'sglang:token_usage{model_name="m"} 0.55\n'
    )
    load = parse_engine_metrics(text, EngineKind.SGLANG)
    assert (load.waiting, load.running) == (4.0, 6.0)
    assert load.kv_usage == pytest.approx(0.55)
    # Each engine reads only its own names.
    assert parse_engine_metrics(text, EngineKind.VLLM) == EMPTY
    assert parse_engine_metrics(SAMPLE, EngineKind.SGLANG) == EMPTY


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_simulator_metrics_page_parses(engine, start_sim, http):
    sim = await start_sim(engine=engine)
    async with http.get(sim.url + "/metrics") as resp:
        text = await resp.text()
    load = parse_engine_metrics(text, EngineKind(engine))
    assert load.waiting == 0.0
    assert load.running == 0.0
    assert load.kv_usage is not None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "garbage",
        "\x00\x01\x02 binary",
        "<html><body>502 Bad Gateway</body></html>",
        "vllm:num_requests_waiting{",
        "vllm:num_requests_waiting not-a-number",
        "vllm:num_requests_waiting{engine=0} 3",
        '# TYPE vllm:num_requests_waiting\nvllm:num_requests_waiting{a="\\"} 1',
        'vllm:num_requests_running{engine="0"} 1 not-a-timestamp',
        "{" * 1000,
    ],
)
@pytest.mark.parametrize("engine", list(EngineKind))
def test_garbage_raises_value_error_or_reads_nothing(text, engine):
    try:
        load = parse_engine_metrics(text, engine)
    except ValueError:
        return
    assert load == EMPTY


async def test_metrics_go_stale_when_the_endpoint_stops_answering(start_upstream, start_gateway, http):
    up = await start_upstream(metrics_text=vllm_metrics(waiting=5, running=2, kv=0.25))
    gw = await start_gateway([up.url], scrape={"interval_s": 0.05, "timeout_s": 0.1, "stale_after_s": 0.3})

    async def row():
        return (await debug_endpoints(http, gw))[up.url]

    async def fresh() -> bool:
        r = await row()
        return r["metrics_stale"] is False and r["waiting"] == 5.0

    await wait_until(fresh, 2.0, "a fresh scrape")
    r = await row()
    assert (r["running"], r["kv_usage"]) == (2.0, 0.25)
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_endpoint_queue_depth", endpoint=up.name) == 5
    assert metric_value(text, "llm_gateway_endpoint_metrics_stale", endpoint=up.name) == 0

    for mode in ("hang", "error"):
        up.metrics_mode = mode

        async def stale() -> bool:
            return (await row())["metrics_stale"] is True

        await wait_until(stale, 2.0, f"metrics to go stale ({mode})")
        text = await gateway_metrics(http, gw)
        assert metric_value(text, "llm_gateway_endpoint_metrics_stale", endpoint=up.name) == 1
        assert (metric_value(text, "llm_gateway_scrape_errors_total", endpoint=up.name) or 0) >= 1
        assert (await row())["healthy"] is True  # stale load is not ill health

        up.metrics_mode = "ok"
        await wait_until(fresh, 2.0, "metrics to be fresh again")


async def test_garbage_metrics_from_one_endpoint_do_not_stop_scraping_others(
    start_upstream, start_gateway, http
):
    broken = await start_upstream(metrics_text="vllm:num_requests_waiting{ this is not prometheus")
    good = await start_upstream(metrics_text=vllm_metrics(waiting=1))
    gw = await start_gateway(
        [broken.url, good.url], scrape={"interval_s": 0.05, "timeout_s": 0.2, "stale_after_s": 0.3}
    )
    await wait_until(lambda: _waiting_is(http, gw, good.url, 1.0), 2.0, "the good endpoint's first scrape")
    good.metrics_text = vllm_metrics(waiting=9)
    await wait_until(lambda: _waiting_is(http, gw, good.url, 9.0), 2.0, "the poller to keep scraping")
    rows = await debug_endpoints(http, gw)
    assert rows[broken.url]["metrics_stale"] is True
    assert rows[broken.url]["waiting"] is None
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_scrape_errors_total", endpoint=broken.name) >= 2


async def _waiting_is(http, gw, url: str, value: float) -> bool:
    row = (await debug_endpoints(http, gw))[url]
    return row["waiting"] == value and row["metrics_stale"] is False
