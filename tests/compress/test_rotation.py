"""Rotations folded into the weights: the rotated full-precision model computes what the original does (norm
scales, biases, tied heads, GQA included); the matrices are orthogonal and seeded; the pipeline records the stage
and writes an artifact the runtime and GGUF export read; bad settings fail before any work."""

import json

import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.compress.api import quantize_configs, rotate
from llmopt.compress.rotation import random_orthogonal
from llmopt.core.errors import ConfigError
from llmopt.core.tiny import build_tiny_model
from tests.formats.runtime_check import assert_runtime_matches_reader

IDS = torch.tensor([[1, 5, 9, 100, 42, 7, 3, 11, 60, 2, 77, 31]])


def randomize_norms(model) -> None:
    """Tiny models start with every norm scale at 1, which would hide a norm left unfolded."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))


def test_random_orthogonal_is_orthogonal_and_seeded():
    q = random_orthogonal(48, seed=3)
    assert torch.allclose(q @ q.t(), torch.eye(48, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, random_orthogonal(48, seed=3)) and not torch.equal(q, random_orthogonal(48, seed=4))


CASES = [(family, overrides, rotations) for family, overrides in [
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),  # biases on the writers o_proj / down_proj too
    ("qwen2", {}),  # tied embeddings, q/k/v biases
] for rotations in (["R1"], ["R2"], ["R1", "R2"])] + [("deepseek", {}, ["R1"])]  # latent attention: R1 only


@pytest.mark.parametrize("family, overrides, rotations", CASES)
def test_the_rotated_model_computes_what_the_original_does(family, overrides, rotations):
    model, _ = build_tiny_model(family, seed=0, **overrides)
    randomize_norms(model)
    with torch.no_grad():
        before = model(input_ids=IDS).logits
    embed_before = model.model.embed_tokens.weight.clone()
    v_before = model.model.layers[0].self_attn.o_proj.weight.clone()
    [config] = quantize_configs("rtn", {"bits": 4, "group_size": 16, "rotate": ",".join(rotations)})[:1]
    facts = rotate(model, config)
    with torch.no_grad():
        after = model(input_ids=IDS).logits
    assert torch.allclose(after, before, atol=1e-4 * before.abs().max())
    assert not torch.equal(v_before, model.model.layers[0].self_attn.o_proj.weight)  # it did rotate
    if "R1" in rotations:
        assert not torch.equal(embed_before, model.model.embed_tokens.weight)
        assert model.config.tie_word_embeddings is False
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
        assert all(torch.equal(p, torch.ones_like(p)) for n, p in model.named_parameters()
                   if n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")))
    assert facts == {"rotations": sorted(rotations), "rotation_seed": 0}


def test_rotation_then_smoothquant_still_computes_what_the_original_does():
    from llmopt.compress.api import smooth_model

    model, tokenizer = build_tiny_model("llama", seed=0)
    randomize_norms(model)
    with torch.no_grad():
        before = model(input_ids=IDS).logits
    rotation, smoother, _ = quantize_configs("rtn", {"scheme": "w8a8-int8", "smoothquant_alpha": 0.5, "rotate": "R1,R2",
                                                     "num_samples": 4, "seqlen": 32, "calib": "pystdlib",
                                                     "compute_dtype": "float32"})
    rotate(model, rotation)
    assert smooth_model(model, tokenizer, smoother).facts()["smoothquant_groups"] > 0
    with torch.no_grad():
        assert torch.allclose(model(input_ids=IDS).logits, before, atol=1e-4 * before.abs().max())


def test_r2_is_refused_where_values_are_not_per_head_linears():
    model, _ = build_tiny_model("deepseek", seed=0)
    [config] = quantize_configs("rtn", {"bits": 4, "group_size": 32, "rotate": "R1,R2"})[:1]
    with pytest.raises(ConfigError, match="R2 needs separate v_proj and o_proj"):
        rotate(model, config)


def test_a_recipe_stage_names_rotations_as_a_list():
    from llmopt.recipe.stages import _validate_quantize

    [config, _] = quantize_configs("rtn", {"bits": 4, "group_size": 16, "rotate": ["r2", "R1"], "rotate_seed": 5})
    assert (config.rotations, config.seed) == (["R1", "R2"], 5)
    _validate_quantize({"method": "rtn", "rotate": ["R1"]})
    with pytest.raises(ConfigError, match="rotations"):
        _validate_quantize({"method": "rtn", "rotate": ["R4"]})


@pytest.mark.parametrize("settings, message", [
    ({"rotate": "R3"}, "rotations"),
    ({"rotate": ""}, "rotations"),
    ({"rotate_seed": 3}, "--rotate-seed seeds a rotation"),
])
def test_bad_rotation_settings_fail_before_any_work(settings, message):
    with pytest.raises(ConfigError, match=message):
        quantize_configs("rtn", {"bits": 4, "group_size": 16, **settings})


def test_rotation_lowers_the_quantization_error_of_outlier_weights():
    """The reason to rotate: a few huge weights make each 4-bit group holding one coarse; rotated, every row's
    values are spread alike (weight error and the logits' KL about halve here)."""
    model, _ = build_tiny_model("llama", seed=0)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 250, (4, 64), generator=generator)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p[torch.rand(p.shape, generator=generator) < 0.01] *= 15
        reference = model(input_ids=ids).logits.log_softmax(-1)

    def quantized_error(rotations):
        from llmopt.compress.api import compress_model

        candidate, tokenizer = build_tiny_model("llama", seed=0)
        candidate.load_state_dict(model.state_dict())
        settings = {"bits": 4, "group_size": 16, "num_samples": 4, "seqlen": 32, "calib": "pystdlib",
                    "compute_dtype": "float32", **({"rotate": rotations} if rotations else {})}
        compress_model(candidate, tokenizer, quantize_configs("rtn", settings))
        with torch.no_grad():
            out = candidate(input_ids=ids).logits.log_softmax(-1)
        return (reference.exp() * (reference - out)).sum(-1).mean().item()  # KL(original || quantized)

    assert quantized_error("R1,R2") < 0.7 * quantized_error(None)


def test_the_cli_rotates_then_quantizes_and_the_artifact_runs(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "rotated"
    result = CliRunner().invoke(app, ["quantize", str(tiny_qwen2_dir), "--method", "rtn", "--group-size", "32",
                                      "--rotate", "r1,r2", "--rotate-seed", "7", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    assert facts["rotations"] == ["R1", "R2"] and facts["rotation_seed"] == 7
    stages = json.loads((out / "llmopt.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["rotate", "quantize"]
    assert stages[0]["settings"] == {"method": "rotation", "rotations": ["R1", "R2"], "seed": 7}
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert_runtime_matches_reader(out, {"int4-cpu"}, [1, 5, 9, 100, 42], max_tokens=4)


def test_rotation_with_max_memory_is_refused_in_one_line(tiny_llama_dir, tmp_path):
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "--method", "rtn", "--group-size", "16",
                                      "--rotate", "R1", "--max-memory", "1GB", "-o", str(tmp_path / "o")])
    assert result.exit_code == 1 and "--rotate" in result.output and "--max-memory" in result.output
    assert not (tmp_path / "o").exists()


def test_a_rotated_tied_model_exports_to_gguf_with_its_own_output_tensor(tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM

    from llmopt.core.tiny import save_tiny_model
    from llmopt.formats.gguf import export_gguf
    from llmopt.formats.read import load_artifact_model

    source = save_tiny_model(tmp_path / "tied", "llama", seed=0, tie_word_embeddings=True)
    out = tmp_path / "rotated"
    result = CliRunner().invoke(app, ["quantize", str(source), "--method", "rtn", "--group-size", "32", "--rotate",
                                      "R1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    export_gguf(out, tmp_path / "rotated.gguf")
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "rotated.gguf")).tensors}
    assert {"output.weight", "token_embd.weight"} <= names
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="rotated.gguf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(theirs(input_ids=IDS).logits, load_artifact_model(out)(input_ids=IDS).logits)
