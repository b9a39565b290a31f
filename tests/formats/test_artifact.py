"""Artifacts: write -> read gives the quantized model back; transformers + compressed-tensors loads ours."""

import copy
import json

import pytest
import torch

from llmopt.compress.api import make_config, quantize_model
from llmopt.core.errors import ArtifactError
from llmopt.core.tiny import build_tiny_model
from llmopt.formats.artifact import write_model_artifact
from llmopt.formats.convert import export_artifact
from llmopt.formats.read import load_artifact_model, read_artifact


@pytest.fixture(scope="module")
def quantized():
    model, tok = build_tiny_model("llama", seed=0)
    config = make_config("gptq", bits=4, group_size=32, calib="pystdlib", num_samples=4, seqlen=32, act_order=True)
    result = quantize_model(model, tok, config)
    return model, tok, result, config


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_write_read_gives_the_quantized_model(tmp_path, quantized, fmt):
    model, tok, result, config = quantized
    out = write_model_artifact(tmp_path / fmt, model, tok, result.qweights, fmt, config.record(),
                               {"stages": []}, dense_dtype=torch.float32)
    contents = read_artifact(out)
    assert set(contents.qweights) == set(result.qweights)
    for name, qw in result.qweights.items():
        back = contents.qweights[name]
        assert torch.equal(back.q, qw.q) and torch.equal(back.zeros, qw.zeros)
        torch.testing.assert_close(back.scales, qw.scales.half().float())
    loaded = load_artifact_model(out)
    # Only the fp16 rounding of the scales separates the two.
    torch.testing.assert_close(logits(loaded, IDS), logits(model, IDS), rtol=2e-3, atol=2e-3)
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["quantization_config"]["quant_method"] == fmt
    assert (out / "llmopt.json").exists()


def test_transformers_with_compressed_tensors_loads_our_artifact(tmp_path, quantized):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, tok, result, config = quantized
    out = write_model_artifact(tmp_path / "ct", model, tok, result.qweights, "compressed-tensors",
                               config.record(), {"stages": []}, dense_dtype=torch.float32)
    ours = load_artifact_model(out)
    theirs = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32)
    theirs.eval()
    # compressed-tensors dequantizes in fp16: differences of ~1e-3 are its rounding, a layout bug is O(1).
    torch.testing.assert_close(logits(theirs, IDS), logits(ours, IDS), rtol=5e-3, atol=5e-3)


def test_asymmetric_3bit_compressed_tensors_through_transformers(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, tok = build_tiny_model("qwen2", seed=3)
    config = make_config("rtn", bits=3, group_size=32, sym=False)
    result = quantize_model(model, tok, config)
    out = write_model_artifact(tmp_path / "ct3", model, tok, result.qweights, "compressed-tensors", config.record(), {},
                               dense_dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32).eval()
    torch.testing.assert_close(logits(theirs, IDS), logits(load_artifact_model(out), IDS), rtol=5e-3, atol=5e-3)


def test_export_between_formats_is_lossless(tmp_path, quantized):
    model, tok, result, config = quantized
    src = write_model_artifact(tmp_path / "src", model, tok, result.qweights, "gptq", config.record(),
                               {"stages": [{"stage": "quantize", "settings": config.model_dump()}]})
    a = export_artifact(src, tmp_path / "awq", "awq")
    b = export_artifact(tmp_path / "awq", tmp_path / "ct", "compressed-tensors")
    assert a["from_format"] == "gptq" and b["from_format"] == "awq"
    original, final = read_artifact(src), read_artifact(tmp_path / "ct")
    for name, qw in original.qweights.items():
        assert torch.equal(final.qweights[name].q, qw.q)
        assert torch.equal(final.qweights[name].scales, qw.scales)
    ct_config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert ct_config["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    stages = json.loads((tmp_path / "ct" / "llmopt.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["quantize", "export", "export"]


def test_act_order_with_static_groups_is_written_as_the_plain_layout(tmp_path, quantized):
    """desc_act false (loaders that refuse act-order take it): every g_idx is k // group_size and the columns are
    stored in their own order; only a permuted g_idx says desc_act true."""
    model, tok, result, config = quantized
    assert config.act_order and config.static_groups
    stages = [{"stage": "quantize", "method": "gptq", "settings": config.model_dump(mode="json")}]  # as the CLI's
    out = write_model_artifact(tmp_path / "gptq", model, tok, result.qweights, "gptq", config.record(),
                               {"stages": stages}, dense_dtype=torch.float32)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["desc_act"] is False and qcfg["static_groups"] is True
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"]
    assert torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=torch.int32) // 32)
    # the record read back still says act-order (llmopt.json), and re-exporting keeps the plain layout
    from llmopt.formats.convert import record_from_artifact

    again = export_artifact(out, tmp_path / "again", "gptq")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]["desc_act"] is False
    assert again["num_quantized_linears"] == len(result.qweights)
    permuted = make_config("gptq", bits=4, group_size=32, act_order=True, static_groups=False).record()
    from llmopt.formats.layouts import FORMATS

    assert FORMATS.get("gptq").quantization_config(permuted)["desc_act"] is True
    assert record_from_artifact(read_artifact(out)).act_order


def test_permuted_act_order_cannot_go_into_awq_and_nothing_is_left(tmp_path):
    model, tok = build_tiny_model("llama", seed=0)
    config = make_config("gptq", bits=4, group_size=32, calib="pystdlib", num_samples=4, seqlen=32,
                         act_order=True, static_groups=False)
    result = quantize_model(model, tok, config)
    src = write_model_artifact(tmp_path / "src", model, tok, result.qweights, "gptq", config.record(), {})
    with pytest.raises(ArtifactError, match="act-order"):
        export_artifact(src, tmp_path / "awq", "awq")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    # The permuted g_idx survives gptq -> compressed-tensors (group actorder, weight_g_idx stored).
    export_artifact(src, tmp_path / "ct", "compressed-tensors")
    for name, qw in read_artifact(tmp_path / "ct").qweights.items():
        assert torch.equal(qw.g_idx, result.qweights[name].g_idx)


def test_awq_search_is_saved_and_reapplied(tmp_path):
    model, tok = build_tiny_model("llama", seed=0)
    fresh = copy.deepcopy(model)
    config = make_config("awq", bits=4, group_size=32, calib="pystdlib", num_samples=4, seqlen=32)
    result = quantize_model(model, tok, config)
    out = write_model_artifact(tmp_path / "awq", model, tok, result.qweights, "awq", config.record(), {},
                               result.extra_tensors)
    from llmopt.formats.artifact import SEARCH_FILE

    replay = make_config("awq", bits=4, group_size=32, search_file=str(out / SEARCH_FILE))
    assert not replay.needs_calibration
    again = quantize_model(fresh, tok, replay)
    for name, qw in result.qweights.items():
        assert torch.equal(again.qweights[name].q, qw.q)
    torch.testing.assert_close(logits(fresh, IDS), logits(model, IDS))
