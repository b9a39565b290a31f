"""One row per variant (of one or several runs): size, ppl per dataset, task accuracy, speed, each with its
change against the baseline variant of the same run."""

from __future__ import annotations

from pathlib import Path

from llmopt.core.errors import ConfigError
from llmopt.core.io import read_json

# (column, how to read it from a variant record, better: "lower" | "higher")
SPEED = [("out tok/s", ("bench", "metrics", "output_throughput"), "higher"),
         ("TTFT ms", ("bench", "metrics", "mean_ttft_ms"), "lower"),
         ("TPOT ms", ("bench", "metrics", "median_tpot_ms"), "lower"),
         ("goodput req/s", ("bench", "metrics", "request_goodput"), "higher"),
         ("batch-1 tok/s", ("bench", "batch1", "metrics", "output_throughput"), "higher"),
         ("batch-1 TPOT ms", ("bench", "batch1", "metrics", "median_tpot_ms"), "lower")]


def load_run(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no results.json: run `llmopt recipe run` first (or pass its -o folder)")
    data = read_json(path)
    variants = data.get("variants") if isinstance(data, dict) else None
    if not isinstance(variants, list) or not variants or not all(
            isinstance(v, dict) and isinstance(v.get("name"), str) for v in variants) or "recipe" not in data:
        raise ConfigError(f"{path} is incomplete (no recipe results in it): re-run `llmopt recipe run` for "
                          f"{run_dir}")
    data["run_dir"] = str(run_dir)
    return data


def _get(record: dict, path: tuple):
    value = record
    for key in path:
        if not isinstance(value, dict) or key not in value or value[key] is None:
            return None
        value = value[key]
    return value


def columns(runs: list[dict]) -> list[tuple[str, tuple, str]]:
    cols = [("size MB", ("size_mb",), "lower")]
    datasets = sorted({d for run in runs for v in run["variants"] for d in (v.get("ppl") or {})})
    cols += [(f"ppl {d}", ("ppl", d), "lower") for d in datasets]
    tasks = sorted({t for run in runs for v in run["variants"] for t in (v.get("tasks") or {})})
    for t in tasks:
        metric = "acc_norm" if any("acc_norm" in (v.get("tasks") or {}).get(t, {}) for run in runs
                                   for v in run["variants"]) else "acc"
        cols.append((f"{t} {metric}", ("tasks", t, metric), "higher"))
    cols += [c for c in SPEED if any(_get(v, c[1]) is not None for run in runs for v in run["variants"])]
    return cols


def rows(runs: list[dict]) -> tuple[list[str], list[list]]:
    """Header and rows: every cell is (value, relative change vs the run's baseline or None)."""
    cols = columns(runs)
    header = ["run", "variant"] + [c[0] for c in cols]
    body = []
    for run in runs:
        by_name = {v["name"]: v for v in run["variants"]}
        for v in run["variants"]:
            v.setdefault("size_mb", (v.get("artifact_bytes") or 0) / 1e6 or None)
        base = by_name.get(run.get("baseline"))
        for v in run["variants"]:
            cells = []
            for _, path, _ in cols:
                value = _get(v, path)
                ref = _get(base, path) if base is not None and base is not v else None
                delta = (value - ref) / ref if isinstance(value, (int, float)) and ref else None
                cells.append((value, delta))
            body.append([run["recipe"] + (f" ({Path(run['run_dir']).name})" if len(runs) > 1 else ""), v["name"],
                         *cells])
    return header, body


def fmt_cell(cell) -> str:
    value, delta = cell
    if value is None:
        return "-"
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text + (f" ({delta:+.1%})" if delta is not None else "")


# what each run's provenance line shows (results.json's "provenance", written by `llmopt recipe run`)
PROVENANCE = (("model", "model"), ("CPU", "cpu"), ("device", "device"), ("llmopt", "llmopt_version"),
              ("commit", "llmopt_commit"), ("torch", "torch"), ("date", "date"))


def provenance(run: dict) -> list[tuple[str, str]]:
    """(label, value) of what ran where for one run; a results.json from before provenance was recorded says so."""
    facts = {**(run.get("provenance") or {}), "model": run.get("model")}
    facts.setdefault("llmopt_version", run.get("llmopt_version"))
    return [(label, str(facts[key]) if facts.get(key) else "not recorded") for label, key in PROVENANCE]


def markdown(runs: list[dict]) -> str:
    header, body = rows(runs)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for row in body:
        lines.append("| " + " | ".join([row[0], row[1], *(fmt_cell(c) for c in row[2:])]) + " |")
    baselines = {run.get("baseline") for run in runs if run.get("baseline")}
    note = f"\nChanges in parentheses are relative to the baseline variant ({', '.join(sorted(baselines))})." \
        if baselines else ""
    where = "".join(f"\n{run['recipe']} ({Path(run['run_dir']).name}): " + "; ".join(
        f"{label} {value}" for label, value in provenance(run)) + "\n" for run in runs)
    return "\n".join(lines) + note + "\n" + where
