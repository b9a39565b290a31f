"""Predictions for deployments of a model on a hardware spec under a workload and an SLO, and the cheapest
deployment that meets it.

A deployment is tp x pp devices per engine instance, a weight scheme, a KV cache dtype, a batch (the concurrent
sequences an instance decodes), and either dp colocated replicas or a prefill:decode split (PD: prefill instances
hand each prompt's KV cache to decode instances over the link). In steady state each of an instance's `batch`
slots serves one request after another: a request's TTFT is its prefill plus a decode step (colocated) or its
prefill plus the KV hand-over (PD); colocated decode steps also carry the prefills of the requests that arrive
(B prompts every `output` steps), PD decode steps carry none. A burst workload (every request at once, as a
benchmark sends them) prefills all prompts first, then decodes the batch; under PD each prefill instance computes
its share of the prompts while the decode instances start on the first ones."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from llmopt.core.errors import ConfigError, file_problem
from llmopt.core.io import read_mapping_file
from llmopt.core.registry import Registry
from llmopt.planner.device_specs import HardwareSpec
from llmopt.planner.roofline import Instance
from llmopt.planner.shape import ModelShape, weight_scheme


@dataclass(frozen=True)
class PlanWorkload:
    """Mean prompt and output lengths; concurrency None: the planner picks the batch."""

    name: str
    input_tokens: int
    output_tokens: int
    concurrency: Optional[int] = None
    rate: Optional[float] = None  # requests/s to serve (None: one instance's worth)
    # all `concurrency` requests arrive at once (a benchmark's burst, `llmopt bench`'s default) rather than each
    # slot's next request as the last one ends
    burst: bool = False


PLAN_WORKLOADS: Registry = Registry("planner workload")
for _w in (
    # ShareGPT first-turn prompts: mean 190 tokens (SmolLM2's tokenizer, the data dir's file of 2,000 prompts);
    # outputs as `llmopt bench --dataset sharegpt` draws them (128)
    PlanWorkload("sharegpt", 190, 128),
    PlanWorkload("batch1", 128, 128, concurrency=1),
    PlanWorkload("batch64", 128, 128, concurrency=64, burst=True),
    PlanWorkload("long", 1024, 128, concurrency=64, burst=True),  # 64 x 1k/128 at once
):
    PLAN_WORKLOADS.add(_w.name, _w)


def plan_workload(spec: str) -> PlanWorkload:
    """--workload NAME (sharegpt, batch1, batch64, long) or a JSON file with input_tokens, output_tokens and
    optionally concurrency and rate."""
    if spec in PLAN_WORKLOADS:
        return PLAN_WORKLOADS.get(spec)
    path = Path(spec)
    if not path.exists():
        raise ConfigError(f"unknown --workload {spec!r}: choose one of {', '.join(PLAN_WORKLOADS.names())} or give a "
                          "JSON file with input_tokens and output_tokens", param="workload")
    what = f"--workload {path}"
    fields = read_mapping_file(path, what, "a mapping with input_tokens and output_tokens (optional: concurrency, "
                                           "rate, burst, name)")
    try:
        checked = WorkloadFile(**fields)
    except ValidationError as e:
        problem = file_problem(e, WorkloadFile.model_fields, ("input_tokens", "output_tokens"))
        raise ConfigError(f"{what}: {problem}", param="workload") from None
    return PlanWorkload(checked.name or path.stem, checked.input_tokens, checked.output_tokens, checked.concurrency,
                        checked.rate, checked.burst)


class WorkloadFile(BaseModel):
    """What a --workload file may hold: token counts and concurrency of at least 1, a rate above 0 (finite)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    input_tokens: StrictInt = Field(ge=1)
    output_tokens: StrictInt = Field(ge=1)
    concurrency: Optional[StrictInt] = Field(None, ge=1)
    rate: Optional[float] = Field(None, gt=0)
    burst: bool = False
    name: Optional[str] = None


def check_rate(rate: float, what: str) -> float:
    """A request rate: finite and above 0."""
    if not (math.isfinite(rate) and rate > 0):
        raise ConfigError(f"{what} {rate}: give requests per second above 0", param="rate")
    return rate


def check_fits_context(workload: PlanWorkload, model: ModelShape) -> None:
    """A workload's prompt and output must fit the model's context (else no deployment could serve it)."""
    if workload.input_tokens + workload.output_tokens > model.max_context:
        raise ConfigError(f"workload {workload.name}: {workload.input_tokens} input + {workload.output_tokens} output "
                          f"tokens exceed {model.name}'s context of {model.max_context}: shorten them",
                          param="workload")


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = math.inf
    tpot_ms: float = math.inf

    @classmethod
    def parse(cls, text: Optional[str]) -> Slo:
        """"ttft=200,tpot=50" (milliseconds; either may be left out)."""
        if not text:
            return cls()
        fields = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            key = key.strip().lower()
            if key not in ("ttft", "tpot"):
                raise ConfigError(f"--slo {text!r}: {key!r} is not ttft or tpot (give ttft=200,tpot=50 in ms)",
                                  param="slo")
            try:
                fields[f"{key}_ms"] = float(value)
            except ValueError:
                raise ConfigError(f"--slo {text!r}: {value!r} is not a number of milliseconds", param="slo") from None
            if not (math.isfinite(fields[f"{key}_ms"]) and fields[f"{key}_ms"] > 0):
                raise ConfigError(f"--slo {text!r}: {key} {value.strip()} ms: give a number of milliseconds above 0",
                                  param="slo")
        return cls(**fields)


@dataclass(frozen=True)
class Deployment:
    scheme: str = "bf16"
    kv_dtype: str = "bf16"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    batch: int = 1
    pd: Optional[tuple[int, int]] = None  # (prefill instances, decode instances)

    @property
    def instances(self) -> int:
        return sum(self.pd) if self.pd else self.dp

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.instances

    def label(self) -> str:
        layout = f"PD {self.pd[0]}:{self.pd[1]}" if self.pd else f"DP {self.dp}"
        return (f"{self.scheme} w, {self.kv_dtype} kv, TP {self.tp} x PP {self.pp}, {layout}, batch {self.batch}")


@dataclass(frozen=True)
class Prediction:
    deployment: Deployment
    ttft_ms: float
    tpot_ms: float
    output_tok_s: float  # all instances together
    requests_per_s: float
    memory_per_device_gib: float
    fits: bool
    meets_slo: bool
    goodput_rps: float  # requests/s served within the SLO (all of them or none, in this steady-state model)

    def as_dict(self) -> dict:
        return {**asdict(self), "deployment": {**asdict(self.deployment), "label": self.deployment.label(),
                                               "devices": self.deployment.devices}}


def predict(model: ModelShape, hardware: HardwareSpec, workload: PlanWorkload, slo: Slo,
            deployment: Deployment) -> Prediction:
    """The steady state of `deployment` serving `workload`."""
    d = deployment
    instance = Instance(model, hardware, weight_scheme(d.scheme), d.kv_dtype, d.tp, d.pp, d.instances)
    n, out, batch = workload.input_tokens, workload.output_tokens, d.batch
    context = n + out / 2  # a decoding sequence's mean cached tokens
    step = instance.decode_step(batch, context)
    prefill = instance.prefill_time(n)
    if d.pd:
        prefills, decodes = d.pd
        handover = hardware.link_latency_us * 1e-6 + instance.kv_memory(n) * instance.ranks / (hardware.link_gb_s * 1e9)
        if workload.burst and batch > 1:
            # every prompt at once: each prefill instance computes its share of them (the median request's first
            # token once half are done) while the decode instances take them as they come, then decode
            share = decodes * batch / prefills
            everyone = instance.step_time(share * n, share, n / 2)
            ttft, tpot = instance.step_time(share * n / 2, share / 2, n / 2) + handover, step
            rps = decodes * batch / (everyone + handover + out * step)
        else:
            ttft, tpot = prefill + handover, step
            decode_rps = decodes * batch / (out * tpot)
            rps = min(decode_rps, prefills / prefill)
    elif workload.burst and batch > 1:
        # every prompt first (chunked prefill in steps of many tokens), then `out` decode steps of the whole batch:
        # the median request has its first token once half the prompts are done
        everyone = instance.step_time(batch * n, batch, n / 2)
        ttft = instance.step_time(batch * n / 2, batch / 2, n / 2)
        # (the median request's decode steps also carry the other half of the prompts, chunk by chunk)
        tpot = step + (everyone - ttft) / out
        rps = d.dp * batch / (everyone + out * step)
    else:
        # each slot's request brings its prompt's FLOPs into the decode steps: B prompts every `out` steps
        tpot = step + batch * instance.prefill_compute(n) / out
        ttft = prefill + step
        rps = d.dp * batch / (ttft + out * tpot)
    memory = instance.weight_memory() + instance.kv_memory(batch * (n + out))
    # (a CPU is one machine: its ranks are its cores, however many replicas a rate would ask for)
    fits = memory <= instance.device_memory() and (hardware.kind != "cpu" or d.devices <= hardware.max_devices)
    meets = fits and ttft * 1e3 <= slo.ttft_ms and tpot * 1e3 <= slo.tpot_ms
    return Prediction(d, ttft * 1e3, tpot * 1e3, rps * out, rps, memory / 2**30, fits, meets,
                      rps if meets else 0.0)


DEFAULT_SCHEMES = {"gpu": ("bf16", "fp8", "int8", "int4"), "cpu": ("fp32", "bf16", "int8", "int4")}
DEFAULT_KV = {"gpu": ("bf16", "fp8"), "cpu": ("fp32", "int8")}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def layouts(model: ModelShape, hardware: HardwareSpec) -> list[tuple[int, int]]:
    """(tp, pp) within one node: tp a power of two that splits the KV heads (or that they divide), pp up to 4."""
    found = []
    for tp in (1, 2, 4, 8):
        if tp > hardware.max_devices or (model.kv_heads % tp and tp % model.kv_heads) or model.heads % tp:
            continue
        for pp in (1, 2, 4):
            if tp * pp <= hardware.max_devices and pp <= model.layers:
                found.append((tp, pp))
    return found


def candidates(model: ModelShape, hardware: HardwareSpec, workload: PlanWorkload, schemes=None, kv_dtypes=None,
               pd: bool = True) -> list[Deployment]:
    """Every deployment the recommendation considers (one instance each; replicas are added for the rate)."""
    schemes = schemes or DEFAULT_SCHEMES[hardware.kind]
    kv_dtypes = kv_dtypes or DEFAULT_KV[hardware.kind]
    batches = (workload.concurrency,) if workload.concurrency else BATCHES
    found = []
    for scheme in schemes:
        for kv in kv_dtypes:
            for tp, pp in layouts(model, hardware):
                for batch in batches:
                    found.append(Deployment(scheme, kv, tp, pp, 1, batch))
                    if pd and 2 * tp * pp <= hardware.max_devices:
                        found.append(Deployment(scheme, kv, tp, pp, 1, batch, pd=(1, 1)))
    return found


def scaled(prediction: Prediction, rate: Optional[float], model, hardware, workload, slo) -> Prediction:
    """The prediction with enough replicas (or PD pairs) for `rate` requests/s."""
    if not rate or not prediction.meets_slo or prediction.requests_per_s >= rate:
        return prediction
    copies = math.ceil(rate / prediction.requests_per_s)
    d = prediction.deployment
    more = replace(d, pd=(d.pd[0] * copies, d.pd[1] * copies)) if d.pd else replace(d, dp=d.dp * copies)
    return predict(model, hardware, workload, slo, more)


def recommend(model: ModelShape, hardware: HardwareSpec, workload: PlanWorkload, slo: Slo,
              schemes=None, kv_dtypes=None) -> tuple[Optional[Prediction], list[Prediction]]:
    """(the cheapest deployment that meets the SLO at the workload's rate, or None; the best per scheme / KV dtype /
    layout for the table). Cheapest: fewest devices, then the most goodput per device, then the widest weights
    (the least accuracy given up)."""
    scheme_order = {s: i for i, s in enumerate(("fp32", "bf16", "fp16", "int8", "fp8", "int4", "fp4"))}
    table: dict[tuple, Prediction] = {}
    meeting = []
    for deployment in candidates(model, hardware, workload, schemes, kv_dtypes):
        p = scaled(predict(model, hardware, workload, slo, deployment), workload.rate, model, hardware, workload, slo)
        key = (deployment.scheme, deployment.kv_dtype, deployment.tp, deployment.pp, bool(deployment.pd))
        best = table.get(key)
        if best is None or (p.goodput_rps, p.output_tok_s) > (best.goodput_rps, best.output_tok_s):
            table[key] = p
        if p.meets_slo:
            meeting.append(p)

    def cost(p: Prediction):
        return (p.deployment.devices, -p.goodput_rps / p.deployment.devices,
                scheme_order.get(p.deployment.scheme, 9))

    return (min(meeting, key=cost) if meeting else None), sorted(table.values(), key=cost)
