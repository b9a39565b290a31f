"""Half-sparse (2:4, 4:8) linears stored compressed: compressed-tensors' sparse-24-bitmask layout, checked against
its definition (values in column order, numpy.packbits with little bit order), written by `llmopt prune`, read back
by our reader, the streamed loader and the runtime."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.core.contract.sparse24 import Sparse24Weight, half_mask, pack_mask, unpack_mask
from llmopt.core.contract.sparsity import compressed_sparsity, quantizes
from llmopt.core.errors import ArtifactError
from llmopt.core.offload import SafetensorsWeights
from llmopt.formats.read import read_artifact

runner = CliRunner()
CALIB = ["--calib", "pystdlib", "--num-samples", "4", "--seqlen", "32"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def half_sparse(n, k, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, k // m, m, generator=g).argsort(-1)[..., : m // 2]
    mask = torch.zeros(n, k // m, m, dtype=torch.bool).scatter_(-1, keep, True).reshape(n, k)
    return torch.randn(n, k, generator=g) * mask


@pytest.mark.parametrize("pattern,m", [("2:4", 4), ("4:8", 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_is_compressed_tensors_definition(pattern, m, dtype):
    weight = half_sparse(12, 40, m).to(dtype)
    weight[0, :m] = 0  # a group with fewer non-zeros keeps its first zeros as values
    stored = Sparse24Weight.from_dense(weight, pattern)
    mask = stored.mask()
    assert mask.reshape(12, -1, m).sum(-1).eq(m // 2).all()
    assert mask[0, :m].tolist() == [True] * (m // 2) + [False] * (m // 2)
    assert torch.equal(stored.values, weight[mask].reshape(12, 20)) and stored.values.dtype == dtype
    np.testing.assert_array_equal(stored.bitmask.numpy(), np.packbits(mask.numpy(), axis=-1, bitorder="little"))
    tensors = stored.to_tensors()
    assert tensors["shape"].tolist() == [[12], [40]] and tensors["bitmask"].shape == (12, 5)
    assert torch.equal(Sparse24Weight.from_tensors(tensors, pattern).decompress(), weight)


def test_bitmask_packing_round_trips_odd_widths():
    mask = torch.rand(5, 19) > 0.5
    assert torch.equal(unpack_mask(pack_mask(mask), 19), mask)


def test_dense_weights_are_refused():
    with pytest.raises(ArtifactError, match="not 2:4 sparse"):
        half_mask(torch.randn(4, 8), "2:4")
    with pytest.raises(ArtifactError, match="2:4 and 4:8"):
        half_mask(torch.zeros(4, 8), "1:4")


def test_positions_give_each_values_column():
    weight = half_sparse(6, 64, 4, seed=1)
    stored = Sparse24Weight.from_dense(weight)
    words = stored.positions_2of4().to(torch.int64) & 0xFFFFFFFF  # [6, 2]
    within = (words.unsqueeze(-1) >> (2 * torch.arange(16))) & 3  # [6, 2, 16]
    columns = torch.arange(16).reshape(2, 8).repeat_interleave(2, dim=1) * 4 + within
    assert torch.equal(columns.reshape(6, 32), stored.mask().nonzero()[:, 1].reshape(6, 32))


def test_config_records_distinguish_sparsity_from_quantization():
    sparse_only = {"quant_method": "compressed-tensors", "config_groups": {},
                   "sparsity_config": {"format": "sparse-24-bitmask"}}
    assert not quantizes(sparse_only) and compressed_sparsity(sparse_only) is not None
    assert quantizes({"quant_method": "gptq"}) and not quantizes(None)


@pytest.fixture(scope="module")
def pruned(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama pruned by SparseGPT 2:4, stored compressed (the default) and dense."""
    base = tmp_path_factory.mktemp("sparse24")
    out = {}
    for storage in ("--save-compressed", "--save-dense"):
        path = base / storage.removeprefix("--save-")
        result = run("prune", tiny_llama_dir, "--method", "sparsegpt", "--pattern", "2:4", storage, *CALIB,
                     "-o", path, "--json")
        assert result.exit_code == 0, result.output
        out[storage.removeprefix("--save-")] = (path, json.loads(result.stdout))
    return out


def test_prune_writes_the_compressed_form(pruned):
    (compressed, facts), (dense, dense_facts) = pruned["compressed"], pruned["dense"]
    config = json.loads((compressed / "config.json").read_text())
    qcfg = config["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["config_groups"] == {}
    assert qcfg["sparsity_config"]["format"] == "sparse-24-bitmask"
    assert qcfg["sparsity_config"]["sparsity_structure"] == "2:4"
    assert config["sparsity_config"]["format"] == "sparse-24-bitmask"
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    # every pruned linear compressed, the same weights as the dense storage
    contents, dense_contents = read_artifact(compressed), read_artifact(dense)
    assert len(contents.sparse) == 14 and not contents.qweights
    for name, stored in contents.sparse.items():
        assert torch.equal(stored.decompress(), dense_contents.dense[f"{name}.weight"]), name
        assert f"{name}.weight" not in contents.dense
    # the linears' bytes: half the fp32 values plus one bit per weight (0.53x), and the file shrinks by as much
    # (less the safetensors header's longer entries)
    linear_bytes = sum(s.shape[0] * s.shape[1] * 4 for s in contents.sparse.values())
    stored_bytes = sum(s.values.nbytes + s.bitmask.nbytes for s in contents.sparse.values())
    assert stored_bytes / linear_bytes == 0.5 + 1 / 32
    saved = dense_facts["artifact_weights_bytes"] - facts["artifact_weights_bytes"]
    assert 0.45 < saved / linear_bytes < 1 - stored_bytes / linear_bytes


def test_compressed_artifact_runs_as_the_dense_one(pruned):
    """Greedy tokens through the runtime (fp32) equal those of the same model stored dense."""
    texts = []
    for storage in ("compressed", "dense"):
        result = run("generate", pruned[storage][0], "--prompt", "def main():", "--max-tokens", 16,
                     "--temperature", 0, "--dtype", "float32", "--json")
        assert result.exit_code == 0, result.output
        texts.append(json.loads(result.stdout)["outputs"][0]["text"])
    assert texts[0] == texts[1]


def test_compressed_artifact_loads_for_the_runtime_with_the_sparse_method(pruned):
    from llmopt.runtime.executor.linear.sparse24_cpu import Sparse24Linear
    from llmopt.runtime.executor.loader import load_runtime_model

    checkpoint, _, _ = load_runtime_model(str(pruned["compressed"][0]))
    assert sum(isinstance(m, Sparse24Linear) for m in checkpoint.modules()) > 0


def test_compressed_input_quantizes_and_streams(pruned, tmp_path):
    """A compressed 2:4 model is not a quantized one: quantize takes it (in memory and streamed), and the
    streamed reader decompresses its linears."""
    compressed = pruned["compressed"][0]
    weights = SafetensorsWeights(compressed)
    dense = read_artifact(pruned["dense"][0]).dense
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(weights.get(name), dense[name])
    for extra in ([], ["--max-memory", "400MB"]):
        out = tmp_path / f"q{len(extra)}"
        result = run("quantize", compressed, "--method", "rtn", "--group-size", 32, *extra, "-o", out)
        assert result.exit_code == 0, result.output
        contents = read_artifact(out)
        assert contents.config["quantization_config"]["quant_method"] == "compressed-tensors"
        # ... and its 2:4 codes are stored compressed again (RTN writes compressed-tensors)
        assert contents.config["sparsity_config"]["format"] == "sparse-24-bitmask"
        assert all(q.keep is not None for q in contents.qweights.values())
        assert torch.all(contents.qweights["model.layers.1.mlp.up_proj"].dequantize()[dense[name] == 0] == 0)
    assert read_artifact(tmp_path / "q0").qweights.keys() == read_artifact(tmp_path / "q2").qweights.keys()


def test_four_of_eight_is_stored_compressed_and_runs_dense(tiny_llama_dir, tmp_path):
    out = tmp_path / "p48"
    assert run("prune", tiny_llama_dir, "--method", "magnitude", "--pattern", "4:8", "-o", out).exit_code == 0
    contents = read_artifact(out)
    assert {s.pattern for s in contents.sparse.values()} == {"4:8"}
    result = run("generate", out, "--prompt", "x", "--max-tokens", 4, "--temperature", 0, "--json")
    assert result.exit_code == 0, result.output


def test_unstructured_sparsity_is_stored_as_sparse_bitmask_and_runs(tiny_llama_dir, tmp_path):
    from llmopt.core.contract.sparse_bitmask import BitmaskWeight
    from llmopt.runtime.executor.linear.sparse_bitmask_cpu import SparseBitmaskLinear
    from llmopt.runtime.executor.loader import load_runtime_model

    texts = []
    for storage in ("--save-compressed", "--save-dense"):
        out = tmp_path / storage
        assert run("prune", tiny_llama_dir, "--method", "wanda", "--sparsity", "0.6", storage, *CALIB,
                   "-o", out).exit_code == 0
        result = run("generate", out, "--prompt", "def main():", "--max-tokens", 16, "--temperature", 0,
                     "--dtype", "float32", "--json")
        assert result.exit_code == 0, result.output
        texts.append(json.loads(result.stdout)["outputs"][0]["text"])
    contents = read_artifact(tmp_path / "--save-compressed")
    assert contents.config["quantization_config"]["sparsity_config"]["format"] == "sparse-bitmask"
    assert len(contents.sparse) == 14 and all(isinstance(w, BitmaskWeight) for w in contents.sparse.values())
    dense = read_artifact(tmp_path / "--save-dense").dense
    for name, stored in contents.sparse.items():
        assert torch.equal(stored.decompress(), dense[f"{name}.weight"])
    checkpoint, _, _ = load_runtime_model(str(tmp_path / "--save-compressed"), dtype="float32")
    assert sum(isinstance(m, SparseBitmaskLinear) for m in checkpoint.modules()) > 0
    assert texts[0] == texts[1]


def test_quantized_2of4_codes_are_stored_compressed(pruned, tmp_path):
    """GPTQ on a 2:4 model into compressed-tensors stores only the kept codes and the bitmask; the GPTQ format
    keeps every code. Same codes, the same greedy tokens through the runtime (sparse24-int4-cpu vs int4-cpu)."""
    from llmopt.runtime.executor.linear.sparse24_int4_cpu import Sparse24Int4Linear
    from llmopt.runtime.executor.loader import load_runtime_model

    outputs = {}
    for fmt in ("compressed-tensors", "gptq"):
        out = tmp_path / fmt
        result = run("quantize", pruned["compressed"][0], "--method", "gptq", "--group-size", 32, "--sym",
                     "--format", fmt, *CALIB, "-o", out, "--json")
        assert result.exit_code == 0, result.output
        outputs[fmt] = (out, json.loads(result.stdout))
    compressed, gptq = read_artifact(outputs["compressed-tensors"][0]), read_artifact(outputs["gptq"][0])
    qcfg = compressed.config["quantization_config"]
    assert qcfg["sparsity_config"]["format"] == "sparse-24-bitmask" and qcfg["format"] == "pack-quantized"
    assert compressed.config["sparsity_config"]["format"] == "sparse-24-bitmask"
    assert gptq.config["sparsity_config"]["format"] == "dense"
    assert len(compressed.qweights) == 14
    for name, qweight in compressed.qweights.items():
        assert qweight.keep is not None
        assert torch.equal(qweight.dequantize(), gptq.qweights[name].dequantize()), name
    packed = outputs["compressed-tensors"][1]["quantized_linear_bytes"]
    assert packed < 0.85 * outputs["gptq"][1]["quantized_linear_bytes"]
    checkpoint, _, _ = load_runtime_model(str(outputs["compressed-tensors"][0]), dtype="float32")
    assert sum(isinstance(m, Sparse24Int4Linear) for m in checkpoint.modules()) > 0
    texts = []
    for fmt in outputs:
        result = run("generate", outputs[fmt][0], "--prompt", "def main():", "--max-tokens", 16, "--temperature", 0,
                     "--dtype", "float32", "--json")
        assert result.exit_code == 0, result.output
        texts.append(json.loads(result.stdout)["outputs"][0]["text"])
    assert texts[0] == texts[1]


def test_unstructured_layout_is_compressed_tensors_sparse_bitmask():
    from llmopt.core.contract.sparse_bitmask import BitmaskWeight

    weight = torch.randn(6, 20) * (torch.rand(6, 20) > 0.6)
    weight[2] = 0
    stored = BitmaskWeight.from_dense(weight)
    mask = weight != 0
    assert torch.equal(stored.values, weight[mask])
    np.testing.assert_array_equal(stored.bitmask.numpy(), np.packbits(mask.numpy(), axis=-1, bitorder="little"))
    counts = mask.sum(-1)
    assert torch.equal(stored.row_offsets, torch.cumsum(counts, 0) - counts)
    assert torch.equal(BitmaskWeight.from_tensors(stored.to_tensors()).decompress(), weight)
    with pytest.raises(ArtifactError, match="set bits"):
        BitmaskWeight.from_tensors({**stored.to_tensors(), "compressed": stored.values[:-1]})


def test_compressed_artifact_serves_the_openai_api(pruned):
    """`llmopt serve` of a compressed 2:4 artifact, through the official client: the same greedy completion as
    the model stored dense."""
    import openai

    from llmopt.runtime.engine.config import EngineConfig
    from llmopt.runtime.executor.loader import load_runtime_model
    from llmopt.serve.launch import in_thread, server_for

    texts = []
    for storage in ("compressed", "dense"):
        model, tokenizer, _ = load_runtime_model(str(pruned[storage][0]), dtype="float32")
        with in_thread(server_for(model, tokenizer, "sparse", EngineConfig(block_size=4))) as base:
            client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
            texts.append(client.completions.create(model="sparse", prompt="def main():", max_tokens=12,
                                                   temperature=0).choices[0].text)
    assert texts[0] == texts[1] and texts[0]
