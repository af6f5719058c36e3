"""``llm-gateway plan`` on the command line: arguments, the printed plan, ``--compare``, ``--live``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gateway.plan.planner import (
    DTYPE_BYTES,
    GB,
    KIB,
    PRESETS,
    ModelSpec,
    Plan,
    PlanError,
    PlanRequest,
    compare,
    dense_model,
    plan,
)

__all__ = ["add_plan_arguments", "run_plan"]


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``llm-gateway plan``'s options; the defaults are the seed's running example."""
    d = PlanRequest(model=PRESETS["llama-3-70b"])
    parser.add_argument(
        "--model", help=f"preset: {', '.join(PRESETS)} (default llama-3-70b unless --params-b etc. are given)"
    )
    parser.add_argument("--params-b", type=float, help="custom dense model: parameters, in billions")
    parser.add_argument("--layers", type=int, help="custom dense model: transformer layers")
    parser.add_argument("--kv-heads", type=int, help="custom dense model: KV heads (GQA groups)")
    parser.add_argument("--head-dim", type=int, help="custom dense model: attention head dimension")
    parser.add_argument("--weights", choices=list(DTYPE_BYTES), default=d.weights, help="weight precision")
    parser.add_argument(
        "--kv-dtype", choices=list(DTYPE_BYTES), default=d.kv_dtype, help="KV cache precision"
    )
    parser.add_argument("--context", type=int, default=d.context, help="tokens per conversation (8k = 8192)")
    parser.add_argument("--users", type=int, default=d.users, help="concurrent conversations")
    parser.add_argument("--gpu-mem-gb", type=float, default=d.gpu_mem_gb, help="GPU memory, GB (10^9 bytes)")
    parser.add_argument("--usable", type=float, default=d.usable, help="usable fraction of GPU memory")
    parser.add_argument(
        "--min-conversations",
        type=int,
        default=d.min_conversations,
        help="a replica must hold at least this many full-context conversations",
    )
    parser.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node, help="GPUs per NVLink node")
    parser.add_argument("--compare", action="store_true", help="every weights/KV precision side by side")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--live", metavar="URL", help="read a running gateway's fleet metrics and report what its load needs"
    )


def _model_from_args(args: argparse.Namespace) -> ModelSpec:
    custom = {"--params-b": args.params_b, "--layers": args.layers, "--kv-heads": args.kv_heads}
    custom["--head-dim"] = args.head_dim
    given = [flag for flag, value in custom.items() if value is not None]
    if given:
        if args.model:
            raise PlanError(f"give either --model or {', '.join(custom)}, not both")
        missing = [flag for flag, value in custom.items() if value is None]
        if missing:
            raise PlanError(f"a custom dense model also needs {', '.join(missing)}")
        return dense_model(args.params_b, args.layers, args.kv_heads, args.head_dim)
    key = (args.model or "llama-3-70b").strip().lower().replace("_", "-")
    if key not in PRESETS:
        raise PlanError(
            f"unknown model {args.model!r}: choose from {', '.join(PRESETS)}, "
            "or describe a dense model with --params-b --layers --kv-heads --head-dim"
        )
    return PRESETS[key]


def _request_from_args(args: argparse.Namespace) -> PlanRequest:
    return PlanRequest(
        model=_model_from_args(args),
        weights=args.weights,
        kv_dtype=args.kv_dtype,
        context=args.context,
        users=args.users,
        gpu_mem_gb=args.gpu_mem_gb,
        usable=args.usable,
        min_conversations=args.min_conversations,
        gpus_per_node=args.gpus_per_node,
    )


def _gb(value: float) -> str:
    """Whole GB once the decimal stops mattering (the seed's "141 GB"), one decimal below 100."""
    return f"{value:,.0f} GB" if value >= 100 else f"{value:.1f} GB"


def _kib(value: int) -> str:
    return f"{value / KIB:g} KiB"


def _header(req: PlanRequest) -> str:
    kind = "MoE" if req.model.moe else "dense"
    return (
        f"{req.model.name} ({req.model.params_b:g}B params, {kind}); {req.context:,}-token conversations, "
        f"{req.users:,} concurrent; {req.gpu_mem_gb:g} GB GPUs, {req.usable:.0%} usable; "
        f">= {req.min_conversations} conversations per replica"
    )


_FOOTER = "Memory floor only: ignores activations, CUDA graphs and throughput/latency SLOs (load-test it)."


def _rows(p: Plan) -> list[tuple[str, str]]:
    return [
        ("weights", _gb(p.weights_gb)),
        ("KV per token", _kib(p.kv_bytes_per_token)),
        ("KV per conversation", f"{p.kv_bytes_per_conversation / GB:.2f} GB"),
        ("GPUs per replica", str(p.gpus_per_replica)),
        ("conversations per replica", f"{p.conversations_per_replica:,}"),
        ("replicas", f"{p.replicas:,}"),
        ("total GPUs", f"{p.total_gpus:,}"),
        ("binding", p.binding),
    ]


def _format_plan(p: Plan) -> str:
    req = p.request
    rows = _rows(p)
    width = max(len(label) for label, _ in rows)
    lines = [f"Fleet plan: weights {req.weights}, KV cache {req.kv_dtype}", _header(req), ""]
    lines += [f"  {label:<{width}}  {value}" for label, value in rows]
    lines += ["", f"Binding: {p.explanation}.", f"Parallelism: {p.parallelism.advice}.", _FOOTER]
    return "\n".join(lines)


def _format_compare(plans: list[Plan]) -> str:
    """One column per precision pair: the fp8-weights-vs-fp8-KV contrast is the point."""
    heads = [f"w {p.request.weights} / KV {p.request.kv_dtype}" for p in plans]
    labels = [label for label, _ in _rows(plans[0])]
    grid = [["precision", *heads]] + [[label] for label in labels]
    for p in plans:
        for row, (_, value) in zip(grid[1:], _rows(p), strict=True):
            row.append(value)
    widths = [max(len(row[col]) for row in grid) for col in range(len(grid[0]))]
    lines = ["Fleet plan, precisions side by side", _header(plans[0].request), ""]
    for row in grid:
        cells = [f"{row[0]:<{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  " + "  ".join(cells))
    lines.append("")
    lines += [f"{h}: {p.parallelism.advice}." for h, p in zip(heads, plans, strict=True)]
    lines.append(_FOOTER)
    return "\n".join(lines)


def _run_live(args: argparse.Namespace) -> int:
    import httpx

    from gateway.plan.live import format_live, read_live

    try:
        report = read_live(args.live)
    except (ValueError, httpx.HTTPError) as exc:
        print(f"llm-gateway plan: error: cannot size from {args.live}: {exc}", file=sys.stderr)
        return 2
    print(format_live(report, args.json))
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (table or ``--json``); bad input is one line on stderr and exit code 2."""
    if getattr(args, "live", None):
        return _run_live(args)
    try:
        request = _request_from_args(args)
        plans = compare(request) if args.compare else [plan(request)]
    except PlanError as exc:
        print(f"llm-gateway plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        body: dict[str, Any] = {"plans": [p.to_dict() for p in plans]} if args.compare else plans[0].to_dict()
        print(json.dumps(body, indent=2))
    else:
        print(_format_compare(plans) if args.compare else _format_plan(plans[0]))
    return 0
