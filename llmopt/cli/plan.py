"""`llmopt plan`: which deployment of a model meets a latency SLO on given hardware, predicted by a roofline model
before any hardware is bought (llmopt/planner)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmopt.cli.options import JsonOpt


def plan(
    model: Annotated[str, typer.Argument(help="A config.json, a model folder, or a model alias (no weights are "
                                              "read).")],
    hardware: Annotated[str, typer.Option("--hardware", help="h200, h100, a100, l4, or cpu (this machine's measured "
                                                            "rates).")] = "h200",
    hardware_file: Annotated[Optional[Path], typer.Option(
        "--hardware-file", help="A JSON / YAML hardware spec: memory_gib, bandwidth_gb_s, flops_tflops {bf16: ...}, "
        "link_gb_s, link_latency_us [, name, kind, compute_efficiency, bandwidth_efficiency, step_overhead_ms, "
        "layer_overhead_us, activation_dtype, max_devices, memory_utilization, source].")] = None,
    workload: Annotated[str, typer.Option(
        "--workload", help="sharegpt, batch1, batch64, long, or a JSON file with input_tokens, output_tokens "
        "[, concurrency, rate].")] = "sharegpt",
    slo: Annotated[Optional[str], typer.Option("--slo", help="Latency targets in ms, e.g. ttft=200,tpot=50.")] = None,
    rate: Annotated[Optional[float], typer.Option("--rate", help="Requests/s to serve (adds replicas).")] = None,
    schemes: Annotated[Optional[str], typer.Option(
        "--schemes", help="Weight schemes to consider, comma-separated (fp32, bf16, fp16, int8, fp8, int4, fp4).")] = None,
    kv_dtypes: Annotated[Optional[str], typer.Option(
        "--kv-dtypes", help="KV cache dtypes to consider, comma-separated (fp32, bf16, fp16, int8, fp8).")] = None,
    rows: Annotated[int, typer.Option("--rows", min=1, help="Table rows to print.")] = 12,
    as_json: JsonOpt = False,
) -> None:
    """Predict throughput, TTFT, TPOT, goodput at the SLO and memory per device for each deployment (TP, PP, DP or a
    prefill:decode split, weight scheme, KV dtype, batch) and recommend the cheapest that meets the SLO."""
    from dataclasses import replace

    from llmopt.cli.output import print_json, print_table, stdout
    from llmopt.planner.device_specs import hardware_spec
    from llmopt.planner.plan import Slo, check_fits_context, check_rate, plan_workload, recommend
    from llmopt.planner.shape import model_shape

    shape = model_shape(model)
    spec = hardware_spec(hardware, str(hardware_file) if hardware_file else None)
    chosen = plan_workload(workload)
    if rate is not None:
        chosen = replace(chosen, rate=check_rate(rate, "--rate"))
    check_fits_context(chosen, shape)
    target = Slo.parse(slo)
    split = (lambda text: tuple(p.strip() for p in text.split(",") if p.strip()) if text else None)
    best, table = recommend(shape, spec, chosen, target, split(schemes), split(kv_dtypes))
    if as_json:
        print_json({"model": shape.name, "hardware": spec.model_dump(), "workload": vars(chosen),
                    "slo": vars(target), "recommendation": best.as_dict() if best else None,
                    "predictions": [p.as_dict() for p in table]})
        return
    print_table(f"{shape.name} on {spec.name}, {chosen.name} ({chosen.input_tokens} in / {chosen.output_tokens} out)",
                [_row(p) for p in table[:rows]])
    if best is None:
        stdout.print(f"no deployment meets ttft <= {target.ttft_ms:g} ms, tpot <= {target.tpot_ms:g} ms on "
                     f"{spec.name}: relax the SLO or try other hardware")
    else:
        p = best
        stdout.print(f"recommended: {p.deployment.label()} on {p.deployment.devices} x {spec.name}: TTFT "
                     f"{p.ttft_ms:.1f} ms, TPOT {p.tpot_ms:.2f} ms, {p.output_tok_s:,.0f} output tok/s, "
                     f"{p.requests_per_s:.2f} req/s, {p.memory_per_device_gib:.1f} GiB per device")


def _row(p) -> dict:
    d = p.deployment
    return {"weights": d.scheme, "kv": d.kv_dtype, "tp x pp": f"{d.tp} x {d.pp}",
            "layout": f"PD {d.pd[0]}:{d.pd[1]}" if d.pd else f"DP {d.dp}", "batch": d.batch, "devices": d.devices,
            "TTFT ms": round(p.ttft_ms, 1), "TPOT ms": round(p.tpot_ms, 2), "out tok/s": round(p.output_tok_s),
            "goodput req/s": round(p.goodput_rps, 2), "GiB/device": round(p.memory_per_device_gib, 1),
            "fits": p.fits, "meets SLO": p.meets_slo}
