"""latency_fit's arithmetic: the constant baseline is each round's warm-up mean, judged on the
same answers as the model."""

from __future__ import annotations

from loadtest.latency_fit import measured, summarise


def test_the_constant_is_the_warm_up_mean_and_both_are_judged_on_the_rest():
    pairs = [(0.0, 10.0), (0.0, 30.0), (40.0, 50.0), (100.0, 100.0)]  # (predicted, observed)
    triples = measured(pairs, warmup=2)
    assert triples == [(40.0, 50.0, 20.0), (100.0, 100.0, 20.0)]
    summary = summarise(triples)
    assert summary["measured"] == 2
    assert summary["model"]["mae_ms"] == 5.0  # |40-50|, |100-100|
    assert summary["constant_mean"]["mae_ms"] == 55.0  # |20-50|, |20-100|
    assert summary["model"]["median_rel_err"] == 0.1  # 0.2 and 0.0


def test_rounds_keep_their_own_constant():
    first = measured([(0.0, 10.0), (5.0, 10.0)], warmup=1)
    second = measured([(0.0, 90.0), (5.0, 10.0)], warmup=1)
    assert [c for _, _, c in first + second] == [10.0, 90.0]
    assert summarise([])["measured"] == 0
