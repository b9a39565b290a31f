"""Recipes: every shipped recipe validates, errors name file:line and the allowed values, the CI smoke
recipe runs end to end and its report matches results.json, and a killed run resumes without redoing
finished stages."""

import html
import json
import os
import signal
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from llmopt.core.errors import ConfigError
from llmopt.recipe.schema import load_recipe
from tests.cli.test_cli import assert_one_line_error, run
from tests.waits import wait_exit, wait_until

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_validate(path):
    assert load_recipe(path).variants


GOOD = """name: t
model: tiny-random-llama
variants:
  fp32: []
  q:
    - quantize: {method: rtn, bits: 4, group_size: 32}
"""


@pytest.mark.parametrize("text,pattern", [
    (GOOD + "colour: red\n", r":7: colour: unknown key; allowed: name, model, defaults"),
    (GOOD.replace("name: t", "name: t\ndefaults: {num_samples: many}"), r":2: defaults.num_samples: .*integer"),
    (GOOD.replace("group_size: 32", "group_size: 32, colour: red"), r":6: variants.q\[0\].quantize: .*colour"),
    (GOOD.replace("bits: 4", "bits: 5"), r":6: variants.q\[0\].quantize: .*bits"),
    (GOOD.replace("quantize:", "distil:"), r"unknown stage 'distil'; allowed: bnb, cast, distill, prune, quantize"),
    (GOOD + "baseline: nope\n", r"baseline 'nope' is not a variant; allowed: fp32, q"),
    (GOOD + "evaluate: {tasks: {names: [mmlu]}}\n", r":7: evaluate.tasks.names: .*unknown task 'mmlu'; allowed:"),
])
def test_recipe_errors_name_file_line_and_allowed_values(tmp_path, text, pattern):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_recipe(path)
    assert str(info.value).startswith(str(path))
    assert_one_line_error(run("recipe", "validate", path), pattern)


def test_a_float_zero_point_is_a_quantize_setting_that_asks_for_asym(tmp_path):
    from llmopt.compress.api import make_config

    path = tmp_path / "r.yaml"
    path.write_text(GOOD.replace("group_size: 32", "group_size: 32, sym: false, zero_point: float"))
    [stage] = load_recipe(path).variants["q"]
    settings = dict(stage["quantize"])
    assert make_config(settings.pop("method"), **settings).weight_scheme.float_zero_point
    path.write_text(GOOD.replace("group_size: 32", "group_size: 32, zero_point: float"))
    with pytest.raises(ConfigError, match=r":6: variants.q\[0\].quantize: .*add --asym"):
        load_recipe(path)


@pytest.mark.parametrize("text, pattern", [
    (GOOD.replace("model: tiny-random-llama", "model: ./no-such-model"), r":2: model: no such folder"),
    (GOOD + "  d:\n    - distill: {max_steps: 2, student_layers: [0, 5]}\n",
     r":8: variants.d\[0\].distill: student_layers: .*0..1 \(the student has 2 layers\)"),
    (GOOD + "  d:\n    - distill: {max_steps: 2, init: 'drop-layers:2'}\n", r":8: .*drop-layers:2: the student has 2"),
    (GOOD + "  d:\n    - distill: {max_steps: 2, teacher: ./no-teacher}\n", r":8: variants.d\[0\].distill: no such"),
    (GOOD + "  d:\n    - distill: {max_steps: 2, data: ./missing.jsonl}\n", r":8: .*missing.jsonl does not exist"),
    (GOOD.replace("group_size: 32", "group_size: 48"), r":6: variants.q\[0\].quantize: --group-size 48 does not"),
    # the shapes follow the stages: after a 25% MLP prune the down projections take 96 inputs
    (GOOD + "  pq:\n    - prune: {structured: mlp, ratio: 0.25}\n    - quantize: {method: rtn, group_size: 64}\n",
     r":9: variants.pq\[1\].quantize: --group-size 64 does not divide .*down_proj.*\(96\)"),
    (GOOD + "  h:\n    - prune: {structured: heads, ratio: 0.9}\n", r":8: .*would remove every attention head"),
    (GOOD + "evaluate: {ppl: {datasets: [./gone.txt]}}\n", r":7: evaluate.ppl.datasets\[0\]: .*gone.txt"),
])
def test_validate_makes_every_check_run_makes_before_work(tmp_path, monkeypatch, text, pattern):
    """`recipe validate` passed these and `recipe run` refused them; now both refuse, naming file:line, and the
    run leaves no folder behind (it left an empty cache folder)."""
    path = tmp_path / "r.yaml"
    path.write_text(text)
    monkeypatch.chdir(tmp_path)
    load_recipe(path)  # the schema alone accepts it: only the model's config shows the problem
    assert_one_line_error(run("recipe", "validate", path), pattern)
    assert_one_line_error(run("recipe", "run", path, "-o", tmp_path / "run"), pattern)
    assert not (tmp_path / "run").exists()


def test_a_run_that_fails_at_once_leaves_no_empty_folders(tmp_path, monkeypatch):
    from llmopt.recipe import stages

    path = tmp_path / "r.yaml"
    path.write_text(GOOD)

    def fails(model, output, options):
        raise ConfigError("the stage broke")

    import dataclasses

    broken = dataclasses.replace(stages.STAGES.get("quantize"), run=fails)
    monkeypatch.setitem(stages.STAGES._items, "quantize", broken)
    monkeypatch.setattr("llmopt.recipe.runner.RecipeRunner.evaluate", lambda *a, **k: {})
    result = run("recipe", "run", path, "-o", tmp_path / "run", "--only", "q")
    assert result.exit_code == 1 and "the stage broke" in result.output, result.output
    assert not (tmp_path / "run").exists()


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.cells = [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_data(self, data):
        self.cells.append(data)


def test_ci_smoke_recipe_runs_and_reports(tmp_path):
    smoke = Path(__file__).parents[2] / "recipes" / "ci-smoke.yaml"
    result = run("recipe", "run", smoke, "-o", tmp_path / "run")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    names = [v["name"] for v in results["variants"]]
    assert names[0] == "fp32" and len(names) == 8
    fp32, bf16 = results["variants"][:2]
    assert bf16["eval_dtype"] == "bfloat16" and fp32["eval_dtype"] == "float32"
    assert abs(bf16["artifact_bytes"] / fp32["artifact_bytes"] - 0.5) < 0.01
    assert bf16["ppl"]["pystdlib"] != fp32["ppl"]["pystdlib"]  # evaluated in bf16, not upcast to fp32
    assert abs(bf16["ppl"]["pystdlib"] / fp32["ppl"]["pystdlib"] - 1) < 0.05
    for v in results["variants"]:
        assert v["ppl"]["pystdlib"] > 1 and v["bench"]["metrics"]["output_throughput"] > 0 and v["artifact_bytes"]
    healed = next(v for v in results["variants"] if v["name"] == "mlp-25-distilled-rtn")
    assert [s["stage"] for s in healed["stages"]] == ["prune", "distill", "quantize"]
    assert healed["stages"][1]["facts"]["steps"] == 4 and healed["stages"][1]["options"]["teacher"] == results["model"]
    quantized = next(v for v in results["variants"] if v["name"] == "gptq-w4g32")
    assert quantized["artifact_bytes"] < 0.5 * results["variants"][0]["artifact_bytes"]
    report = run("report", tmp_path / "run", "-o", tmp_path / "r.html", "--markdown", tmp_path / "r.md")
    assert report.exit_code == 0, report.output
    parser = _Images()
    parser.feed((tmp_path / "r.html").read_text())
    assert len(parser.images) == 3 and all(src.startswith("data:image/png;base64,") for src in parser.images)
    md = (tmp_path / "r.md").read_text()
    # the page names what ran where: model, CPU line, llmopt version and commit (or that none is known), date
    from llmopt.core.hardware import cpu_line

    page = (tmp_path / "r.html").read_text()
    for text in ("tiny-random-llama", html.escape(cpu_line()), results["provenance"]["date"], "llmopt", "commit"):
        assert text in page and html.unescape(text) in md, text
    for v in results["variants"]:  # the report's numbers are results.json's
        assert f"{v['ppl']['pystdlib']:.4g}" in md
        assert f"{v['ppl']['pystdlib']:.4g}" in "".join(parser.cells)
    # a second run reuses every stage and measurement
    again = run("recipe", "run", smoke, "-o", tmp_path / "run")
    assert again.exit_code == 0 and "cached" in again.output
    second = json.loads((tmp_path / "run" / "results.json").read_text())["variants"]
    facts = lambda vs: [(v["ppl"], v["bench"], v["artifact_bytes"], [s["facts"] for s in v["stages"]]) for v in vs]  # noqa: E731
    assert facts(second) == facts(results["variants"])
    # --only re-runs one variant and keeps the others' results (it used to leave 1 of 8)
    only = run("recipe", "run", smoke, "-o", tmp_path / "run", "--only", "rtn-w4g32")
    assert only.exit_code == 0, only.output
    merged = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [v["name"] for v in merged["variants"]] == names and facts(merged["variants"]) == facts(second)
    # variants were benched in a shuffled order (not the file's), recorded in the results
    assert sorted(results["bench_order"]) == sorted(names) and results["bench_order"] != names
    # a pruned model that is then quantized keeps both stages in its manifest
    chain = next(v for v in results["variants"] if v["name"] == "sparsegpt-2of4-gptq")
    manifest = json.loads((Path(chain["model"]) / "llmopt.json").read_text())
    assert [s["stage"] for s in manifest["stages"]] == ["prune", "quantize"]


KILL_RECIPE = """name: kill
model: tiny-random-llama
defaults: {calib: pystdlib, num_samples: 8, seqlen: 64}
variants:
  rtn:
    - quantize: {method: rtn, bits: 4, group_size: 32}
  gptq:  # more calibration than the rest, so the kill below lands while this variant runs
    - prune: {method: sparsegpt, pattern: "2:4", num_samples: 128, seqlen: 256}
    - quantize: {method: gptq, bits: 4, group_size: 32, num_samples: 128, seqlen: 256}
evaluate:
  ppl: {datasets: [pystdlib], seqlen: 64, max_tokens: 1024}
"""


def test_resume_after_sigkill(tmp_path):
    recipe = tmp_path / "kill.yaml"
    recipe.write_text(KILL_RECIPE)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "llmopt", "recipe", "run", str(recipe), "-o", str(run_dir)]
    env = {**os.environ, "LLMOPT_DEBUG": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    def first_stage_done_and_a_later_one_started() -> bool:
        done = list((run_dir / "cache").glob("quantize-*/llmopt.json")) if (run_dir / "cache").exists() else []
        return bool(done and list((run_dir / "cache").glob("ppl-*.json")))

    try:
        wait_until(first_stage_done_and_a_later_one_started, 600, "the first variant's quantize stage", proc, 0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        wait_exit(proc, 60, "the recipe run after SIGKILL")
    assert not (run_dir / "results.json").exists()
    finished = run(*cmd[3:], "--resume")
    assert finished.exit_code == 0, finished.output
    assert "rtn: quantize cached" in finished.output
    resumed = json.loads((run_dir / "results.json").read_text())
    fresh = run(*cmd[3:-2], "-o", tmp_path / "fresh")
    assert fresh.exit_code == 0, fresh.output
    clean = json.loads((tmp_path / "fresh" / "results.json").read_text())
    assert [v["ppl"] for v in resumed["variants"]] == [v["ppl"] for v in clean["variants"]]


def test_bnb_variant_is_measured_through_transformers(tmp_path):
    pytest.importorskip("bitsandbytes")
    recipe = tmp_path / "bnb.yaml"
    recipe.write_text("""name: bnb
model: tiny-random-llama
variants:
  fp32: []
  nf4:
    - bnb: {quant_type: nf4}
evaluate:
  ppl: {datasets: [pystdlib], seqlen: 64, max_tokens: 1024}
bench: {dataset: random, num_requests: 2, input_len: 8, output_len: 4, dtype: float32}
baseline: fp32
""")
    result = run("recipe", "run", recipe, "-o", tmp_path / "run")
    assert result.exit_code == 0, result.output
    fp32, nf4 = json.loads((tmp_path / "run" / "results.json").read_text())["variants"]
    assert nf4["bench"]["backend"] == "hf" and fp32["bench"]["backend"] == "runtime"
    assert nf4["artifact_bytes"] < 0.6 * fp32["artifact_bytes"]
    assert abs(nf4["ppl"]["pystdlib"] / fp32["ppl"]["pystdlib"] - 1) < 0.2  # nf4 stays close to fp32


def test_a_recipe_can_bench_its_variants_served_over_http(tmp_path):
    recipe = tmp_path / "served.yaml"
    recipe.write_text("""name: served
model: tiny-random-llama
variants:
  rtn:
    - quantize: {method: rtn, bits: 4, group_size: 32}
bench: {dataset: random, num_requests: 4, input_len: 16, output_len: 8, dtype: float32, serve: true}
""")
    result = run("recipe", "run", recipe, "-o", tmp_path / "run")
    assert result.exit_code == 0, result.output
    [variant] = json.loads((tmp_path / "run" / "results.json").read_text())["variants"]
    assert variant["bench"]["backend"] == "http"
    assert variant["bench"]["metrics"]["completed"] == 4 and variant["bench"]["metrics"]["total_output_tokens"] == 32


def test_a_recipe_bench_can_add_a_batch1_row(tmp_path):
    recipe = tmp_path / "batch1.yaml"
    recipe.write_text("""name: batch1
model: tiny-random-llama
variants:
  fp32: []
  rtn:
    - quantize: {method: rtn, bits: 4, group_size: 32}
bench: {dataset: random, num_requests: 6, input_len: 16, output_len: 8, dtype: float32, batch1: true}
baseline: fp32
""")
    result = run("recipe", "run", recipe, "-o", tmp_path / "run")
    assert result.exit_code == 0, result.output
    for variant in json.loads((tmp_path / "run" / "results.json").read_text())["variants"]:
        batched, single = variant["bench"]["metrics"], variant["bench"]["batch1"]["metrics"]
        assert batched["completed"] == 6 and single["completed"] == 4  # the first 4 requests, one at a time
        assert single["mean_batch_size"] == 1 < batched["mean_batch_size"]
    report = run("report", tmp_path / "run", "-o", tmp_path / "report.html", "--markdown", tmp_path / "report.md")
    assert report.exit_code == 0, report.output
    assert "batch-1 tok/s" in (tmp_path / "report.md").read_text()


def test_report_plots_show_each_request_and_draw_a_front_only_where_there_is_one(monkeypatch):
    """The latency panels plot every request's sample (not a box alone, which a burst's alike requests collapse to
    a line); the Pareto front's legend appears only where a front of two or more variants is drawn."""
    from llmopt.report import html as report

    def run_of(variants):
        return [{"recipe": "r", "run_dir": "/x/run", "model": "m", "variants": variants}]

    def variant(name, tok_s, ppl, ttft):
        return {"name": name, "ppl": {"d": ppl}, "bench": {"metrics": {"output_throughput": tok_s},
                                                          "ttft_ms": ttft, "tpot_ms": [1.0] * len(ttft)}}

    drawn = {"scatter": [], "legend": 0}
    import matplotlib.axes

    real_scatter, real_legend = matplotlib.axes.Axes.scatter, matplotlib.axes.Axes.legend
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter",
                        lambda self, x, y, *a, **k: drawn["scatter"].append(len(list(y))) or real_scatter(
                            self, x, y, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "legend",
                        lambda self, *a, **k: drawn.update(legend=drawn["legend"] + 1) or real_legend(self, *a, **k))
    # a trade-off (faster and worse): a front of two, with its legend; every request a dot
    report.plots(run_of([variant("a", 10, 5.0, [2.0, 2.1, 2.2]), variant("b", 20, 6.0, [1.0, 1.1])]))
    assert drawn["legend"] == 1 and [3, 2] == drawn["scatter"][-4:-2]
    # one variant best on both: no front, no legend
    drawn.update(scatter=[], legend=0)
    report.plots(run_of([variant("a", 20, 5.0, [2.0]), variant("b", 10, 6.0, [1.0])]))
    assert drawn["legend"] == 0
    assert report.provenance(run_of([])[0])[1] == ("CPU", "not recorded")  # (a results.json from before it)
