"""`llmopt distill --medusa-heads`: the heads' loss falls, the file loads back bit-identically, a resumed run
continues the same losses, and the runtime serves with the trained heads (same greedy tokens)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.core.medusa import MedusaHeads
from llmopt.core.tiny import build_tiny_model
from llmopt.runtime.engine.config import EngineConfig, SpeculativeConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.jobs.distill import run_dir_for
from llmopt.distill.checkpoint import MODEL_FILE
from tests.distill.test_distill import kill_after_logged_steps

COMMON = ["distill", "--teacher", "tiny-random-llama", "--medusa-heads", "2", "--data", "pystdlib", "--seqlen", "40",
          "--batch-size", "2", "--lr", "1e-2", "--warmup", "2", "--eval-windows", "4", "--max-steps", "16"]


def losses(output):
    return [json.loads(line) for line in (run_dir_for(output) / "log.jsonl").read_text().splitlines()]


def test_training_lowers_the_heads_loss_and_the_file_loads_back(tmp_path):
    out = tmp_path / "heads"
    result = CliRunner().invoke(app, COMMON + ["-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    kl_before, kl_after = facts["initial_held_out_head_kl"], facts["held_out_head_kl"]
    assert all(after < 0.95 * before for before, after in zip(kl_before, kl_after)), (kl_before, kl_after)
    heads = MedusaHeads.load(out / "medusa_heads.safetensors")
    from safetensors.torch import load_file

    trained = load_file(str(run_dir_for(out) / "checkpoint" / MODEL_FILE))
    for name, tensor in heads.state_dict().items():
        assert torch.equal(tensor, trained[name])  # the file holds exactly the trained weights
    manifest = json.loads((out / "llmopt.json").read_text())
    assert manifest["stages"][0]["settings"]["medusa_heads"] == 2

    model, tok = build_tiny_model("llama", seed=0)
    prompts = [[5, 6, 7, 8] * 3, [40, 41, 42]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = Engine(model, tok, EngineConfig(block_size=4)).generate(prompts, params)
    engine = Engine(model, tok, EngineConfig(block_size=4, speculative=SpeculativeConfig("medusa", str(out))))
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    assert engine.stats().spec_decode.num_draft_tokens > 0


def test_a_killed_run_resumes_onto_the_same_losses(tmp_path):
    runner = CliRunner()
    whole = tmp_path / "whole"
    assert runner.invoke(app, COMMON + ["-o", str(whole)]).exit_code == 0
    killed = tmp_path / "killed"
    kill_after_logged_steps([*COMMON, "--save-every", "1", "-o", str(killed)], run_dir_for(killed) / "log.jsonl", 5)
    assert not killed.exists()
    result = runner.invoke(app, COMMON + ["--save-every", "1", "-o", str(killed), "--resume"])
    assert result.exit_code == 0, result.output
    want = [r["loss"] for r in losses(whole) if "loss" in r]
    got = [r["loss"] for r in losses(killed) if "loss" in r]
    assert len(got) == len(want) == 16
    assert got == pytest.approx(want, abs=1e-6)


def test_medusa_heads_refuse_a_student(tmp_path):
    result = CliRunner().invoke(app, COMMON + ["--student-layers", "0", "-o", str(tmp_path / "x")])
    assert result.exit_code == 1 and "--student-layers" in result.output and "Traceback" not in result.output
