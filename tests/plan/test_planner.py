"""``llm-gateway plan``: the capacity seed's worked examples, hand-computed cases, binding, bad input."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from typing import Any

import pytest

from gateway.plan.cli import add_plan_arguments, run_plan
from gateway.plan.planner import (
    PRESETS,
    PlanError,
    PlanRequest,
    compare,
    dense_model,
    kv_bytes_per_token,
    plan,
)

GB = 10**9
KIB = 1024


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llm-gateway plan")
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = run_plan(_parse(*argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    rc, out, err = _run(capsys, *argv, "--json")
    assert (rc, err) == (0, "")
    return json.loads(out)


SEED = dict(context=8192, users=1000, gpu_mem_gb=80.0, usable=0.9, min_conversations=8)

# (preset, weights, kv) -> (weights GB as the seed prints it, GPUs/replica, conversations/replica,
#  replicas, total GPUs); the seed states every one of these numbers.
SEED_EXAMPLES = {
    ("llama-3-70b", "bf16", "bf16"): (141, 4, 54, 19, 76),
    ("llama-3-70b", "fp8", "bf16"): (71, 2, 27, 38, 76),  # 70.6 GB; the seed gives no figure
    ("deepseek-v3", "fp8", "bf16"): (671, 16, 835, 2, 32),
}


# --- the seed's worked examples ----------------------------------------------------------------------


@pytest.mark.parametrize(("key", "expected"), SEED_EXAMPLES.items(), ids=lambda v: "-".join(map(str, v)))
def test_seed_examples_via_api(key: tuple[str, str, str], expected: tuple[int, ...]) -> None:
    model, weights, kv = key
    p = plan(PlanRequest(model=PRESETS[model], weights=weights, kv_dtype=kv, **SEED))
    got = (round(p.weights_gb), p.gpus_per_replica, p.conversations_per_replica, p.replicas, p.total_gpus)
    assert got == expected


@pytest.mark.parametrize(("key", "expected"), SEED_EXAMPLES.items(), ids=lambda v: "-".join(map(str, v)))
def test_seed_examples_via_cli_json(
    capsys: pytest.CaptureFixture[str], key: tuple[str, str, str], expected: tuple[int, ...]
) -> None:
    model, weights, kv = key
    body = _run_json(
        capsys,
        "--model",
        model,
        "--weights",
        weights,
        "--kv-dtype",
        kv,
        "--context",
        "8192",
        "--users",
        "1000",
    )
    got = tuple(body[k] for k in ("gpus_per_replica", "conversations_per_replica", "replicas", "total_gpus"))
    assert (round(body["weights_gb"]), *got) == expected
    assert body["binding"] in ("weights", "kv_cache")


def test_seed_exact_weights_and_kv_sizes() -> None:
    """141 GB bf16 / 70.6 GB fp8 for Llama 3 70B, 671 GB for DeepSeek-V3; 8B/70B/405B/MLA KV per token."""
    assert plan(PlanRequest(model=PRESETS["llama-3-70b"])).weights_gb == pytest.approx(141.2)
    assert plan(PlanRequest(model=PRESETS["llama-3-70b"], weights="fp8")).weights_gb == pytest.approx(70.6)
    assert plan(PlanRequest(model=PRESETS["deepseek-v3"], weights="fp8")).weights_gb == pytest.approx(671)
    kib = {name: spec.kv_bytes_per_token_bf16 / KIB for name, spec in PRESETS.items()}
    assert kib == {"llama-3-8b": 128, "llama-3-70b": 320, "llama-3-405b": 504, "deepseek-v3": 68.625}
    assert round(kib["deepseek-v3"]) == 69  # the seed's "about 69"


def test_seed_fp8_weights_do_not_cut_gpus_and_deepseek_is_two_nodes() -> None:
    bf16, fp8 = compare(PlanRequest(model=PRESETS["llama-3-70b"]))[:2]
    assert (bf16.request.weights, fp8.request.weights) == ("bf16", "fp8")
    assert bf16.total_gpus == fp8.total_gpus == 76
    assert fp8.kv_bytes_per_conversation == bf16.kv_bytes_per_conversation  # "the KV cache didn't shrink"
    ds = plan(PlanRequest(model=PRESETS["deepseek-v3"], weights="fp8"))
    assert (ds.parallelism.tp, ds.parallelism.pp, ds.parallelism.nodes_per_replica) == (8, 2, 2)
    assert ds.parallelism.ep == 16


def test_unit_conventions_are_the_ones_that_reproduce_the_seed() -> None:
    """Each alternative reading breaks one of the seed's numbers, which is why the module uses ours."""
    request = PlanRequest(model=PRESETS["llama-3-70b"])
    flat_70b = replace(request, model=replace(PRESETS["llama-3-70b"], params_b=70.0))
    assert plan(flat_70b).conversations_per_replica == 55  # not 54: the weights are 70.6B
    gib_gpus = replace(request, gpu_mem_gb=80 * 2**30 / GB)
    assert plan(gib_gpus).conversations_per_replica > 54  # 80 GiB GPUs: too many conversations
    flat_69 = replace(PRESETS["deepseek-v3"], kv_bytes_per_token_bf16=69 * KIB)
    assert plan(PlanRequest(model=flat_69, weights="fp8")).conversations_per_replica == 831  # not 835
    exact_70b = replace(request, model=replace(PRESETS["llama-3-70b"], params_b=70.553706496))
    assert plan(exact_70b).conversations_per_replica == 54  # the exact count agrees


# --- hand-computed cases ----------------------------------------------------------------------------


def test_llama_8b_fits_one_gpu() -> None:
    p = plan(PlanRequest(model=PRESETS["llama-3-8b"], **SEED))
    weights = 8.03e9 * 2
    kv_conv = 8192 * 32 * 8 * 128 * 2 * 2  # 1 GiB
    assert p.weights_bytes == weights
    assert p.kv_bytes_per_conversation == kv_conv == 2**30
    assert p.gpus_per_replica == 1
    assert p.conversations_per_replica == math.floor((72e9 - weights) / kv_conv) == 52
    assert (p.replicas, p.total_gpus) == (math.ceil(1000 / 52), 20)
    assert (p.parallelism.tp, p.parallelism.pp, p.parallelism.ep) == (1, 1, 1)
    assert p.binding == "kv_cache"


def test_fp8_kv_halves_kv_per_conversation() -> None:
    base = PlanRequest(model=PRESETS["llama-3-70b"])
    bf16, fp8 = plan(base), plan(replace(base, kv_dtype="fp8"))
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token == 320 * KIB
    assert fp8.kv_bytes_per_conversation * 2 == bf16.kv_bytes_per_conversation
    # same 4-GPU replica, (288 - 141.2) GB / 1.342 GB = 109.4 conversations
    assert (fp8.gpus_per_replica, fp8.conversations_per_replica, fp8.replicas, fp8.total_gpus) == (
        4,
        109,
        10,
        40,
    )


def test_custom_dense_model(capsys: pytest.CaptureFixture[str]) -> None:
    """A Llama-2-13B-shaped MHA model: 13B params, 40 layers, 40 KV heads, head dim 128."""
    kv_token = 2 * 40 * 40 * 128 * 2
    assert kv_bytes_per_token(40, 40, 128) == kv_token == 800 * KIB
    body = _run_json(
        capsys,
        *("--params-b", "13", "--layers", "40", "--kv-heads", "40", "--head-dim", "128"),
        *("--context", "4096", "--users", "100"),
    )
    conversations = math.floor((72e9 - 26e9) / (4096 * kv_token))  # 46 GB / 3.36 GB = 13.7
    assert conversations == 13
    assert body["weights_gb"] == 26
    assert body["kv_bytes_per_token"] == kv_token
    assert (body["gpus_per_replica"], body["conversations_per_replica"]) == (1, 13)
    assert (body["replicas"], body["total_gpus"]) == (8, 8)
    assert body["moe"] is False


def test_replica_grows_by_powers_of_two_until_min_conversations_fit() -> None:
    """fp8 70B fits one GPU's 72 GB by weight alone (70.6 GB) but not with 8 conversations."""
    request = PlanRequest(model=PRESETS["llama-3-70b"], weights="fp8")
    assert plan(request).gpus_per_replica == 2
    assert plan(replace(request, min_conversations=1, context=256)).gpus_per_replica == 1
    big = plan(PlanRequest(model=PRESETS["llama-3-405b"]))  # 812 GB of weights
    assert (big.gpus_per_replica, big.parallelism.tp, big.parallelism.pp) == (16, 8, 2)
    assert big.parallelism.ep == 1  # dense: no expert parallelism


# --- binding: "weights" iff the weights take more than half of the replica's usable memory ----------


def test_binding_examples() -> None:
    llama = plan(PlanRequest(model=PRESETS["llama-3-70b"]))
    assert llama.binding == "kv_cache" and llama.weights_share < 0.5
    deepseek = plan(PlanRequest(model=PRESETS["deepseek-v3"], weights="fp8"))
    assert deepseek.binding == "weights" and deepseek.weights_share > 0.5
    assert deepseek.explanation.startswith("weights bind")
    assert llama.explanation.startswith("KV cache binds")


def test_binding_threshold_is_half_the_replica() -> None:
    tiny_kv = dict(layers=1, kv_heads=1, head_dim=1)  # 4 B/token: the replica stays one 72 GB GPU
    at_half = plan(PlanRequest(model=dense_model(18.0, **tiny_kv), context=1000, users=1))
    assert at_half.gpus_per_replica == 1 and at_half.weights_bytes == at_half.kv_space_bytes == 36 * GB
    assert at_half.binding == "kv_cache"  # a tie is not "weights dominate"
    over = plan(PlanRequest(model=dense_model(18.001, **tiny_kv), context=1000, users=1))
    assert over.binding == "weights"


# --- command line -------------------------------------------------------------------------------------


def test_defaults_are_the_seed_example_and_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys)
    assert (rc, err) == (0, "")
    assert "Llama 3 70B" in out and "141 GB" in out
    for label, value in (
        ("GPUs per replica", "4"),
        ("conversations per replica", "54"),
        ("total GPUs", "76"),
    ):
        assert any(line.split() == [*label.split(), value] for line in out.splitlines()), label
    assert "Binding: KV cache binds" in out
    assert "Parallelism: TP=4 within one NVLink node; 19 data-parallel replicas" in out


def test_deepseek_text_gives_seed_004_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--model", "deepseek-v3", "--weights", "fp8")
    assert rc == 0
    assert "835" in out and "671 GB" in out
    assert "TP=8 within each node x PP=2 across 2 nodes" in out
    assert "EP=16" in out
    assert "Binding: weights bind" in out


def test_compare_shows_each_precision(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--compare")
    assert rc == 0
    for head in ("w bf16 / KV bf16", "w fp8 / KV bf16", "w bf16 / KV fp8", "w fp8 / KV fp8"):
        assert head in out
    totals = next(line for line in out.splitlines() if line.strip().startswith("total GPUs")).split()[2:]
    assert totals == ["76", "76", "40", "38"]


def test_compare_json(capsys: pytest.CaptureFixture[str]) -> None:
    body = _run_json(capsys, "--compare", "--model", "deepseek-v3")
    got = {(p["weights_dtype"], p["kv_dtype"]): p["total_gpus"] for p in body["plans"]}
    assert got == {("bf16", "bf16"): 32, ("fp8", "bf16"): 32, ("bf16", "fp8"): 32, ("fp8", "fp8"): 16}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--users", "0"), "--users must be at least 1"),
        (("--context", "0"), "--context must be at least 1"),
        (("--model", "gpt-5"), "unknown model 'gpt-5'"),
        (("--params-b", "7", "--layers", "32"), "also needs --kv-heads, --head-dim"),
        (("--model", "llama-3-8b", "--params-b", "7"), "either --model or"),
        (("--usable", "1.5"), "--usable must be in (0, 1]"),
        (("--gpu-mem-gb", "0.001"), "does not fit on 1024 GPUs"),
        # finite but huge: overflowed into a traceback (exit 1) once multiplied out
        (("--gpu-mem-gb", "1e300"), "--gpu-mem-gb must be a positive number up to"),
        (("--params-b", "1e300", "--layers", "80", "--kv-heads", "8", "--head-dim", "128"), "up to 1e+06 B"),
    ],
)
def test_invalid_input_exits_2(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    rc, out, err = _run(capsys, *argv, "--json")
    assert rc == 2
    assert out == ""
    assert err.startswith("llm-gateway plan: error: ") and message in err


def test_bad_precision_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit) as exc:
        _parse("--weights", "int3")
    assert exc.value.code == 2


def test_api_raises_plan_error() -> None:
    with pytest.raises(PlanError, match="--users"):
        plan(PlanRequest(model=PRESETS["llama-3-8b"], users=0))
    with pytest.raises(PlanError, match="--head-dim"):
        dense_model(7, 32, 8, 0)
