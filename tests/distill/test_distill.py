"""Distillation end to end on tiny models: the KL falls, pruned zeros stay zero, quantized students keep their
codes and format, narrower students get a projection, and a killed run resumes onto the same losses."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.core.errors import ConfigError
from llmopt.core.tiny import build_tiny_model, save_tiny_model
from llmopt.distill.config import make_distill_config, parse_duration
from llmopt.distill.data import training_windows
from llmopt.distill.losses import divergence_loss
from llmopt.distill.student import layer_pairs
from llmopt.jobs.distill_students import build_student
from llmopt.distill.trainer import Distiller
from llmopt.formats.load import load_model
from llmopt.formats.read import read_artifact
from llmopt.jobs.distill import distill_to_artifact, run_dir_for
from tests.waits import communicate, limit, wait_exit, wait_until

TEACHER = "tiny-random-llama"
FAST = dict(data="pystdlib", seqlen=32, batch_size=4, max_train_tokens=20_000, eval_windows=2, warmup=2)


def log_of(output):
    return [json.loads(line) for line in (run_dir_for(output) / "log.jsonl").read_text().splitlines()]


def mean_kl(student_path, windows):
    teacher, _, _ = load_model(TEACHER)
    student, _, _ = load_model(str(student_path))
    with torch.no_grad():
        ids = windows[:4]
        s, t = student(input_ids=ids).logits, teacher(input_ids=ids).logits
        return float(divergence_loss(s.flatten(0, 1), t.flatten(0, 1), ids.flatten()))


def test_distilling_a_differently_initialized_student_halves_the_kl(tmp_path):
    save_tiny_model(tmp_path / "student", "llama", seed=1)
    _, tokenizer, _ = load_model(TEACHER)
    windows = training_windows(tokenizer, "pystdlib", 32, 2, 20_000, 0).held_out
    before = mean_kl(tmp_path / "student", windows)
    config = make_distill_config(teacher=TEACHER, student=str(tmp_path / "student"), max_steps=40, lr=3e-3, **FAST)
    facts = distill_to_artifact(config, tmp_path / "out")
    after = mean_kl(tmp_path / "out", windows)
    assert after < 0.5 * before, (before, after)
    assert facts["steps"] == 40 and facts["student_kind"] == "dense"
    manifest = json.loads((tmp_path / "out" / "llmopt.json").read_text())
    assert manifest["stages"][0]["settings"]["max_steps"] == 40
    assert manifest["teacher"]["model"] == TEACHER
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.num_hidden_layers == 2


def test_plain_fine_tuning_needs_no_teacher_forward(tmp_path):
    config = make_distill_config(teacher=TEACHER, max_steps=3, alpha=0.0, **FAST)
    distill_to_artifact(config, tmp_path / "out")
    records = [r for r in log_of(tmp_path / "out") if "loss" in r]
    assert all("kd" not in r and r["ce"] == r["loss"] for r in records)


def test_sparse_students_keep_their_zeros_exactly(tmp_path):
    from llmopt.jobs.prune import prune_config, prune_to_artifact

    prune_to_artifact(TEACHER, tmp_path / "sparse", prune_config(dict(method="magnitude", pattern="2:4",
                                                                      calib="pystdlib", num_samples=4, seqlen=32)))
    config = make_distill_config(teacher=TEACHER, student=str(tmp_path / "sparse"), max_steps=5, lr=1e-2, **FAST)
    facts = distill_to_artifact(config, tmp_path / "out")
    assert facts["student_kind"] == "sparse"
    before, after = read_artifact(tmp_path / "sparse"), read_artifact(tmp_path / "out")
    assert len(before.sparse) == len(after.sparse) == 14  # stored compressed (2:4), healed and stored so again
    changed = 0
    for name, stored in before.sparse.items():
        weight, trained = stored.decompress(), after.sparse[name].decompress()
        zeros = weight == 0
        assert zeros.float().mean() >= 0.5
        assert torch.all(trained[zeros] == 0), name
        changed += int(not torch.equal(trained, weight))
    assert changed > 0  # the kept weights did train
    assert after.config["sparsity_config"] == before.config["sparsity_config"]
    assert after.config["quantization_config"] == before.config["quantization_config"]


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_quantized_students_train_scales_and_keep_codes_and_format(tmp_path, fmt):
    from llmopt.compress.api import quantize_configs
    from llmopt.jobs.quantize import quantize_to_artifact

    configs = quantize_configs("rtn", dict(bits=4, group_size=32, sym=fmt == "gptq"))
    quantize_to_artifact(TEACHER, tmp_path / "q", configs, fmt)
    config = make_distill_config(teacher=TEACHER, student=str(tmp_path / "q"), max_steps=4, lr=1e-2, **FAST)
    facts = distill_to_artifact(config, tmp_path / "out")
    assert facts["student_kind"] == "quantized"
    before, after = read_artifact(tmp_path / "q"), read_artifact(tmp_path / "out")
    assert after.fmt.name == fmt and after.config["quantization_config"] == before.config["quantization_config"]
    assert set(after.qweights) == set(before.qweights)
    moved = 0
    for name, qweight in before.qweights.items():
        assert torch.equal(after.qweights[name].q, qweight.q), name
        moved += int(not torch.allclose(after.qweights[name].scales, qweight.scales))
    assert moved > 0
    model, _, _ = load_model(str(tmp_path / "out"))  # the reader loads what was written
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def test_layer_dropped_and_narrower_students(tmp_path):
    teacher, tokenizer = build_tiny_model("llama", seed=0, num_hidden_layers=4)
    config = make_distill_config(teacher=TEACHER, student_layers="0,3", max_steps=1, hidden_loss="mse", **FAST)
    student = build_student(config, teacher, tokenizer)
    assert student.model.config.num_hidden_layers == 2 and student.teacher_layers == [0, 3]
    assert layer_pairs(config, student, 4) == [(0, 0), (3, 1)]
    narrow = make_distill_config(teacher=TEACHER, student=str(save_tiny_model(tmp_path / "narrow", "llama", seed=1,
                                                                              hidden_size=32)),
                                 max_steps=2, hidden_loss="cosine", **FAST)
    student = build_student(narrow, teacher, tokenizer)
    windows = training_windows(tokenizer, "pystdlib", 32, 2, 20_000, 0)
    distiller = Distiller(narrow, teacher, student, tokenizer, windows, tmp_path / "run")
    assert tuple(distiller.projection.weight.shape) == (64, 32)
    record = distiller.train_step()
    assert record["hidden"] > 0 and distiller.projection.weight.grad is None  # zeroed after the step
    assert layer_pairs(narrow, student, 4) == [(1, 0), (3, 1)]


def test_drop_layers_init_keeps_the_most_important_layers(tmp_path):
    teacher, tokenizer = build_tiny_model("llama", seed=0, num_hidden_layers=4)
    config = make_distill_config(teacher=TEACHER, init="drop-layers:2", max_steps=1, **FAST)
    student = build_student(config, teacher, tokenizer)
    assert student.model.config.num_hidden_layers == 2
    assert len(student.facts["kept_layers"]) == 2 and student.teacher_layers == student.facts["kept_layers"]


def test_on_policy_batches_are_the_students_own_generations(tmp_path):
    config = make_distill_config(teacher=TEACHER, max_steps=2, on_policy_ratio=1.0, on_policy_prompt_len=8,
                                 student_layers="0", **FAST)
    distill_to_artifact(config, tmp_path / "out")
    records = [r for r in log_of(tmp_path / "out") if "loss" in r]
    assert all(r["on_policy"] for r in records) and all(r["kd"] >= 0 for r in records)


def kill_after_logged_steps(args: list[str], log, steps: int) -> None:
    """Run `llmopt ARGS` in a subprocess and SIGKILL it once its step log has `steps` lines."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "llmopt", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: log.is_file() and sum(1 for _ in log.open()) >= steps, 600,
                   f"{steps} logged steps", proc, 0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        wait_exit(proc, 60, "the distillation run after SIGKILL")
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def test_a_killed_run_resumes_onto_the_same_losses(tmp_path):
    common = ["distill", "--teacher", TEACHER, "--student-layers", "0", "--data", "pystdlib", "--seqlen", "32",
              "--batch-size", "2", "--max-train-tokens", "20000", "--max-steps", "12", "--lr", "3e-3",
              "--warmup", "2", "--save-every", "1"]
    runner = CliRunner()
    result = runner.invoke(app, common + ["-o", str(tmp_path / "whole")])
    assert result.exit_code == 0, result.output
    whole = [r["loss"] for r in log_of(tmp_path / "whole") if "loss" in r]

    killed = tmp_path / "killed"
    kill_after_logged_steps([*common, "-o", str(killed)], run_dir_for(killed) / "log.jsonl", 5)
    assert not killed.exists()
    result = runner.invoke(app, common + ["-o", str(killed), "--resume"])
    assert result.exit_code == 0, result.output
    resumed = [r["loss"] for r in log_of(killed) if "loss" in r]
    assert len(resumed) == len(whole) == 12
    assert resumed == pytest.approx(whole, abs=1e-6)


def test_tied_embeddings_checkpoint_once_and_resume(tmp_path):
    save_tiny_model(tmp_path / "tied", "llama", seed=0, tie_word_embeddings=True)
    config = make_distill_config(teacher=str(tmp_path / "tied"), max_steps=2, student_layers="0", **FAST)
    distill_to_artifact(config, tmp_path / "out")
    more = make_distill_config(**{**config.model_dump(), "max_steps": 3, "schedule": "constant"})
    facts = distill_to_artifact(more, tmp_path / "out", resume=True, overwrite=True, allow_changes=True)
    assert facts["steps"] == 3
    model, _, _ = load_model(str(tmp_path / "out"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_ctrl_c_checkpoints_and_exits_130_then_resumes(tmp_path):
    out = tmp_path / "out"
    args = [sys.executable, "-m", "llmopt", "distill", "--teacher", TEACHER, "--student-layers", "0", "--data",
            "pystdlib", "--seqlen", "32", "--batch-size", "2", "--max-train-tokens", "20000", "--max-steps", "100000",
            "-o", str(out)]
    proc = subprocess.Popen(args, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = run_dir_for(out) / "log.jsonl"
    wait_until(lambda: log.is_file() and log.stat().st_size > 0, 600, "the first logged step", proc)
    proc.send_signal(signal.SIGINT)
    _, err = communicate(proc, 180, "the distillation run after SIGINT")
    assert proc.returncode == 130, err[-2000:]
    assert "--resume" in err
    state = json.loads((run_dir_for(out) / "checkpoint" / "state.json").read_text())
    assert state["step"] >= 1 and not out.exists()
    # the same settings but the end: under the cosine schedule a new end changes the learning rates
    config = make_distill_config(teacher=TEACHER, student_layers="0", max_steps=state["step"] + 1, data="pystdlib",
                                 seqlen=32, batch_size=2, max_train_tokens=20000)
    with pytest.raises(ConfigError, match=r"max_steps 100000 -> \d+.*--allow-changes"):
        distill_to_artifact(config, out, resume=True)
    facts = distill_to_artifact(config, out, resume=True, allow_changes=True)
    assert facts["steps"] == state["step"] + 1


def test_bf16_autocast_trains(tmp_path):
    config = make_distill_config(teacher=TEACHER, student_layers="0", max_steps=2, dtype="bfloat16", **FAST)
    facts = distill_to_artifact(config, tmp_path / "out")
    assert facts["steps"] == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in log_of(tmp_path / "out")
                                       if "loss" in r)


def test_an_earlier_checkpoint_is_not_overwritten_silently(tmp_path):
    config = make_distill_config(teacher=TEACHER, max_steps=1, student_layers="0", **FAST)
    distill_to_artifact(config, tmp_path / "out")
    (tmp_path / "out").rename(tmp_path / "gone")  # output gone, checkpoint folder still there
    with pytest.raises(ConfigError, match="--resume"):
        distill_to_artifact(config, tmp_path / "out")
    distill_to_artifact(config, tmp_path / "out", overwrite=True)  # starting over is explicit


RESUMABLE = ["--teacher", TEACHER, "--student-layers", "0", "--data", "pystdlib", "--seqlen", "32",
             "--batch-size", "2", "--max-train-tokens", "20000", "--lr", "3e-3", "--schedule", "constant"]


def ckpt_folders(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


def test_resume_compares_the_settings_with_the_checkpoint(tmp_path):
    out = tmp_path / "out"
    runner = CliRunner()
    first = runner.invoke(app, ["distill", *RESUMABLE, "--max-steps", "2", "-o", str(out)])
    assert first.exit_code == 0, first.output
    # a finished output is not rewritten by --resume alone (it was)
    again = runner.invoke(app, ["distill", *RESUMABLE, "--max-steps", "3", "-o", str(out), "--resume"])
    assert again.exit_code == 1 and "already exists" in again.output and "--overwrite" in again.output
    # a changed learning rate or batch size is named with both values (it resumed silently)
    changed = runner.invoke(app, ["distill", *RESUMABLE, "--max-steps", "3", "--lr", "1e-3", "--batch-size", "4",
                                  "-o", str(out), "--resume", "--overwrite"])
    assert changed.exit_code == 1, changed.output
    line = changed.output.strip()
    assert "lr 0.003 -> 0.001" in line and "batch_size 2 -> 4" in line and "--allow-changes" in line
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    # logging, evaluation and checkpoint cadence, and the end under a constant schedule, are free to change
    free = runner.invoke(app, ["distill", *RESUMABLE, "--max-steps", "3", "--log-every", "2", "--save-every", "1",
                               "-o", str(out), "--resume", "--overwrite"])
    assert free.exit_code == 0, free.output
    assert json.loads((run_dir_for(out) / "checkpoint" / "state.json").read_text())["step"] == 3
    # on purpose: --allow-changes continues with the new settings
    allowed = runner.invoke(app, ["distill", *RESUMABLE, "--max-steps", "4", "--lr", "1e-3", "-o", str(out),
                                  "--resume", "--overwrite", "--allow-changes"])
    assert allowed.exit_code == 0, allowed.output
    stage = json.loads((out / "llmopt.json").read_text())["stages"][-1]
    assert stage["settings"]["lr"] == 1e-3 and stage["resumed_with_changes"]["lr"] == [0.003, 0.001]


def test_refused_resumes_leave_no_folders(tmp_path):
    runner = CliRunner()
    nothing = runner.invoke(app, ["distill", *RESUMABLE, "--max-steps", "2", "-o", str(tmp_path / "o"), "--resume"])
    assert nothing.exit_code == 1 and "no checkpoint" in nothing.output, nothing.output
    assert ckpt_folders(tmp_path) == []  # it left an empty o.ckpt/
    alone = runner.invoke(app, ["distill", *RESUMABLE, "--max-steps", "2", "-o", str(tmp_path / "o"),
                                "--allow-changes"])
    assert alone.exit_code == 1 and "--allow-changes applies to --resume only" in alone.output
    assert ckpt_folders(tmp_path) == []


@pytest.mark.parametrize("args, message", [
    (["--max-steps", "0"], "max_steps"),
    ([], "--max-steps and/or --max-time"),
    (["--max-time", "soon"], "duration"),
    (["--max-steps", "1", "--init", "drop-everything"], "drop-layers:N"),
    (["--max-steps", "1", "--layer-map", "a:b"], "layer-map"),
    (["--max-steps", "1", "--alpha", "0", "--hidden-loss", "mse"], "alpha"),
])
def test_bad_options_give_one_line_errors(tmp_path, args, message):
    result = CliRunner().invoke(app, ["distill", "--teacher", TEACHER, "-o", str(tmp_path / "o"), *args])
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output


def test_durations():
    assert parse_duration("15m") == 900 and parse_duration("1h30m") == 5400 and parse_duration("90") == 90
    with pytest.raises(ValueError):
        parse_duration("15 minutes")


@pytest.mark.slow
def test_two_processes_follow_the_one_process_loss_curve(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on CPU (torchrun underneath; the trainer's Accelerator
    runs gloo), each process half of the same global batch."""
    common = ["distill", "--teacher", TEACHER, "--student-layers", "0", "--data", "pystdlib", "--seqlen", "32",
              "--max-train-tokens", "20000", "--max-steps", "4", "--lr", "3e-3", "--warmup", "1",
              "--dtype", "float32"]  # (auto is bf16 on CPUs with bf16 units: its rounding exceeds the tolerance)
    result = CliRunner().invoke(app, common + ["--batch-size", "4", "-o", str(tmp_path / "one")])
    assert result.exit_code == 0, result.output
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "llmopt"]
    done = subprocess.run(launch + common + ["--batch-size", "2", "-o", str(tmp_path / "two")], env=env,
                          capture_output=True, text=True, timeout=limit(600))
    assert done.returncode == 0, done.stderr[-3000:]
    one = [r["loss"] for r in log_of(tmp_path / "one") if "loss" in r]
    two = [r["loss"] for r in log_of(tmp_path / "two") if "loss" in r]
    assert len(one) == len(two) == 4
    assert two == pytest.approx(one, abs=1e-4)
    assert one[0] != one[-1]
