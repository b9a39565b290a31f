"""Running a recipe: each variant's stages, then evaluation and bench, every result cached by a key of
(input, stage or measurement config, llmopt version) under RUN_DIR/cache, so a re-run or --resume skips
finished work. Stage outputs are written to a temporary folder and renamed (the pipelines do that), and a
measurement's JSON is written then renamed, so a killed run never leaves a result that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from llmopt import __version__
from llmopt.core.errors import LLMOptError
from llmopt.core.io import read_json, write_json
from llmopt.recipe.schema import Recipe
from llmopt.recipe.stages import STAGES

BATCH1_REQUESTS = 4  # requests of a bench's batch-1 run (bench.batch1)


def run_summary(run) -> dict:
    """What a recipe keeps of one bench run: its metrics and each request's TTFT and TPOT (ms)."""
    return {"metrics": run.metrics, "ttft_ms": [r.ttft * 1000 for r in run.records],
            "tpot_ms": [r.tpot * 1000 for r in run.records if r.tpot is not None]}

LogFn = Callable[[str], None]


def cache_key(*parts) -> str:
    blob = json.dumps([__version__, *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _weights_bytes(model: str) -> int | None:
    from llmopt.core.io import weights_bytes
    from llmopt.core.models import resolve_model

    path = resolve_model(model).path  # None for a hub id
    return weights_bytes(path) if path else None


class RecipeRunner:
    def __init__(self, recipe: Recipe, run_dir: str | Path, log: LogFn | None = None):
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.cache = self.run_dir / "cache"
        self.cache.mkdir(parents=True, exist_ok=True)
        self.log = log or (lambda message: None)
        self.stages_run: list[str] = []  # keys of stages actually executed (not cached) in this run

    # --- stages -------------------------------------------------------------------------------
    def stage_chain(self, name: str):
        """The variant's stages as (stage name, options with the recipe's defaults, cache key of its output);
        each key chains the previous one, from the recipe's model."""
        key = cache_key(self.recipe.model)
        for stage in self.recipe.variants[name]:
            ((stage_name, options),) = stage.items()
            options = self.recipe.stage_options(stage_name, options or {})
            key = cache_key(key, stage_name, options)
            yield stage_name, options, key

    def build_variant(self, name: str) -> tuple[str, str, list[dict]]:
        """Run (or reuse) the variant's stages; returns (MODEL to measure, its cache key, stage records)."""
        model, key, records = self.recipe.model, cache_key(self.recipe.model), []
        for i, (stage_name, options, key) in enumerate(self.stage_chain(name)):
            out = self.cache / f"{stage_name}-{key}"
            start = time.perf_counter()
            if (out / "stage_facts.json").is_file():  # written (atomically) only after the folder is complete
                self.log(f"{name}: {stage_name} cached ({out.name})")
                facts = read_json(out / "stage_facts.json")
            else:
                self.log(f"{name}: {stage_name} {options}")
                try:
                    facts = STAGES.get(stage_name).run(model, out, options)
                except LLMOptError as e:  # which variant and stage, then what the stage said
                    raise type(e)(f"variant {name!r}, stage {i} ({stage_name}): {e}") from e
                write_json(out / "stage_facts.json", facts, indent=1)
                self.stages_run.append(f"{name}/{i}/{stage_name}")
            records.append({"stage": stage_name, "options": options, "artifact": str(out), "cache_key": key,
                            "wall_s": round(time.perf_counter() - start, 2), "facts": facts})
            model = str(out)
        return model, key, records

    # --- measurements -------------------------------------------------------------------------
    def _cached(self, kind: str, key: str, config: dict, compute: Callable[[], dict]) -> dict:
        path = self.cache / f"{kind}-{cache_key(key, kind, config)}.json"
        if path.is_file():
            return read_json(path)
        result = compute()
        write_json(path, result, indent=1)
        return result

    def evaluate(self, model: str, key: str, dtype: str | None = None) -> dict:
        from llmopt.core.datasets import tokenize_corpus
        from llmopt.formats.load import load_model
        from llmopt.eval.perplexity import perplexity
        from llmopt.eval.tasks import evaluate_task

        spec, out, loaded = self.recipe.evaluate, {}, {}
        dtype = dtype or self.recipe.defaults.dtype

        def lm():
            if not loaded:
                loaded["model"], loaded["tokenizer"], _ = load_model(model, dtype=dtype)
            return loaded["model"], loaded["tokenizer"]

        if spec.ppl:
            out["ppl"] = {}
            for dataset in spec.ppl.datasets:
                config = {"dataset": dataset, **spec.ppl.model_dump(exclude={"datasets"}), "dtype": dtype}

                def compute(dataset=dataset):
                    m, tok = lm()
                    ids = tokenize_corpus(tok, dataset, spec.ppl.max_tokens, "eval")
                    return perplexity(m, ids, seqlen=spec.ppl.seqlen, batch_size=spec.ppl.batch_size).to_dict()

                out["ppl"][dataset] = self._cached("ppl", key, config, compute)["ppl"]
        if spec.tasks:
            out["tasks"] = {}
            for task in spec.tasks.names:
                config = {"task": task, "limit": spec.tasks.limit, "dtype": dtype}
                out["tasks"][task] = self._cached(
                    "task", key, config, lambda task=task: evaluate_task(*lm(), task, spec.tasks.limit,
                                                                         spec.tasks.batch_size))
        return out

    def bench(self, model: str, key: str, through_hf: bool = False) -> dict | None:
        """The recipe's workload through the runtime, or through transformers' generate (`through_hf`: models
        whose layers come from outside llmopt, e.g. bitsandbytes)."""
        spec = self.recipe.bench
        if spec is None:
            return None

        def measure(name: str, workload, config):
            from llmopt.core.hardware import resolve_dtype
            from llmopt.eval.bench import HttpTarget, bench_hf, bench_http, bench_runtime
            from llmopt.serve.launch import serving

            if through_hf:
                return bench_hf(name, model, workload, config)
            if spec.serve:
                with serving(model, config.engine, resolve_dtype(spec.dtype, config.device)) as url:
                    return bench_http(name, model, workload, config, HttpTarget(url, model=model))
            return bench_runtime(name, model, workload, config)

        def compute():
            from llmopt.eval.metrics import parse_slo
            from llmopt.eval.bench import BenchConfig
            from llmopt.eval.workloads import WorkloadSpec

            workload = WorkloadSpec(spec.dataset, spec.num_requests, spec.input_len, spec.output_len,
                                    spec.range_ratio, request_rate=spec.request_rate, seed=self.recipe.defaults.seed)
            config = BenchConfig(dtype=spec.dtype, engine=spec.engine_config(),
                                 slo=tuple(parse_slo(spec.slo).items()))
            out = {"backend": "hf" if through_hf else "http" if spec.serve else "runtime",
                   **run_summary(measure("bench", workload, config))}
            if spec.batch1:  # the workload's first few requests, one at a time
                single = replace(workload, num_requests=min(BATCH1_REQUESTS, workload.num_requests))
                out["batch1"] = run_summary(measure("bench-batch1", single,
                                                    replace(config, max_concurrency=1, hf_batch_size=1)))
            return out

        config = {**spec.model_dump(mode="json", exclude={"order"}), "hf": through_hf}  # order: not a setting
        return self._cached("bench", key, config, compute)

    # --- the whole recipe ---------------------------------------------------------------------
    def variant_key(self, name: str) -> str:
        """The cache key build_variant gives the variant's model, computed without running anything."""
        key = cache_key(self.recipe.model)
        for _, _, key in self.stage_chain(name):
            pass
        return key

    def bench_order(self, names: list[str]) -> list[str]:
        """The order variants are benched in: shuffled (seeded by defaults.seed) unless the recipe's bench says
        `order: recipe`, so whatever the first measurement of a process still pays (caches, clocks, allocator
        growth) does not always fall on the first variant of the file, usually the baseline."""
        import random

        order = list(names)
        if self.recipe.bench is None or self.recipe.bench.order == "shuffled":
            random.Random(self.recipe.defaults.seed).shuffle(order)
        return order

    def run(self, only: list[str] | None = None) -> dict:
        names = [name for name in self.recipe.variants if not only or name in only]
        records = {}
        for name in names:
            start = time.perf_counter()
            model, key, stages = self.build_variant(name)
            self.log(f"{name}: evaluating")
            # A variant that ends in a cast is evaluated in its dtype (bf16 weights and bf16 compute).
            cast = next((s["facts"]["dtype"] for s in reversed(stages) if s["stage"] == "cast"), None)
            records[name] = {"name": name, "model": model, "cache_key": key, "stages": stages,
                             "artifact_bytes": _weights_bytes(model), "eval_dtype": cast or self.recipe.defaults.dtype,
                             **self.evaluate(model, key, cast), "wall_s": time.perf_counter() - start}
        order = self.bench_order(names)
        for name in order:
            start, record = time.perf_counter(), records[name]
            self.log(f"{name}: bench")
            record["bench"] = self.bench(record["model"], record["cache_key"],
                                         through_hf=any("bnb" in s for s in self.recipe.variants[name]))
            record["wall_s"] = round(record["wall_s"] + time.perf_counter() - start, 2)
        if only:
            records.update(self.earlier_records(exclude=names))
        from llmopt.core.environment import run_provenance

        results = {"recipe": self.recipe.name, "model": self.recipe.model, "baseline": self.recipe.baseline,
                   "llmopt_version": __version__, "provenance": run_provenance(),
                   "recipe_config": self.recipe.model_dump(mode="json"),
                   "bench_order": order if self.recipe.bench else [],
                   "variants": [records[name] for name in self.recipe.variants if name in records]}
        write_json(self.run_dir / "results.json", results, indent=1)
        return results

    def earlier_records(self, exclude: list[str]) -> dict[str, dict]:
        """Variants of an earlier results.json that `--only` did not re-run and that are still what the recipe
        says (same name, same cache key): a partial re-run adds to the results instead of replacing them."""
        path = self.run_dir / "results.json"
        if not path.is_file():
            return {}
        try:
            earlier = read_json(path)
        except Exception:  # a damaged file is replaced by this run's results, not merged
            self.log(f"{path} is unreadable: it is replaced by this run's variants only")
            return {}
        kept = {}
        for record in earlier.get("variants", []) if isinstance(earlier, dict) else []:
            name = record.get("name") if isinstance(record, dict) else None
            if name in self.recipe.variants and name not in exclude:
                if record.get("cache_key") == self.variant_key(name):
                    kept[name] = record
                else:
                    self.log(f"{name}: its earlier result is stale (the recipe changed): dropped")
        return kept
