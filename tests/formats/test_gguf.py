"""GGUF export: block encodings against the `gguf` package's own decoder, the file read back by transformers'
GGUF loader (the same logits and tokens as our artifact), refusals with reasons, the CLI, and llama.cpp itself
where llama-cpp-python is installed."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.compress.api import make_config, quantize_model
from llmopt.core.contract import QuantizedWeight, QuantScheme, default_g_idx
from llmopt.core.errors import ArtifactError
from llmopt.core.tiny import build_tiny_model
from llmopt.formats.artifact import write_model_artifact
from llmopt.formats.gguf import block_type, decode_blocks, encode_blocks, export_gguf, gguf_name, rope_permutation
from llmopt.formats.read import load_artifact_model

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def random_qweight(bits: int, group: int, sym: bool, n: int = 8, k: int = 128, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    scheme = QuantScheme(bits, group, sym)
    groups = k // group if group != -1 else 1
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.1 + 0.01).half().float()  # fp16 values, as artifacts store
    zeros = (torch.full((n, groups), 2 ** (bits - 1)) if sym else torch.randint(0, 2**bits, (n, groups), generator=g))
    return QuantizedWeight(q, scales, zeros.to(torch.int32), default_g_idx(k, scheme), scheme)


@pytest.mark.parametrize("bits, group, sym, kind", [(4, 32, True, "Q4_0"), (4, 64, True, "Q4_0"), (4, -1, True, "Q4_0"),
                                                    (8, 128, True, "Q8_0"), (4, 32, False, "Q4_1")])
def test_blocks_decode_to_our_weights(bits, group, sym, kind):
    qw = random_qweight(bits, group, sym)
    assert block_type(qw, "l") == kind
    data = encode_blocks(qw, kind)
    assert data.dtype == np.uint8 and data.shape == (8, 128 // 32 * {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind])
    decoded = decode_blocks(data, kind, qw.shape)
    if kind == "Q4_1":  # m = -z d rounded to fp16
        torch.testing.assert_close(decoded, qw.dequantize(), rtol=0, atol=float(qw.scales.max()) * 16 * 2**-11)
    else:
        assert torch.equal(decoded, qw.dequantize())  # exact


@pytest.mark.parametrize("bits, group, sym, why", [(3, 32, True, "3-bit"), (8, 32, False, "asymmetric 8-bit"),
                                                   (4, 16, True, "whole 32-value")])
def test_codes_without_an_exact_block_type_are_refused_with_the_reason(bits, group, sym, why):
    with pytest.raises(ArtifactError, match=why):
        block_type(random_qweight(bits, group, sym, k=96 if bits == 3 else 128), "l")


def test_rope_rows_are_permuted_as_llama_cpp_s_converter_does():
    heads, head_dim, k = 4, 8, 3
    w = torch.arange(heads * head_dim * k).view(heads * head_dim, k)
    # llama.cpp's LlamaModel.permute: reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)
    theirs = w.numpy().reshape(heads, 2, head_dim // 2, k).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(w[rope_permutation(heads * head_dim, heads)].numpy(), theirs)
    assert gguf_name("model.layers.3.self_attn.o_proj.weight") == "blk.3.attn_output.weight"
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    # a rotary base other than the default, as SmolLM2's (100,000): the file must carry it
    model, tok = build_tiny_model("llama", seed=0, rope_theta=100000.0)
    config = make_config("gptq", bits=4, group_size=32, calib="pystdlib", num_samples=4, seqlen=32)
    result = quantize_model(model, tok, config)
    sym = write_model_artifact(root / "gptq", model, tok, result.qweights, "gptq", config.record(), {"stages": []})
    model, tok = build_tiny_model("llama", seed=0)
    permuted = make_config("gptq", bits=4, group_size=32, calib="pystdlib", num_samples=4, seqlen=32,
                           act_order=True, static_groups=False)
    result = quantize_model(model, tok, permuted)
    act = write_model_artifact(root / "act", model, tok, result.qweights, "gptq", permuted.record(), {"stages": []})
    return root, sym, act


def test_transformers_reads_the_gguf_back_to_our_logits_and_tokens(artifacts):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, artifact, _ = artifacts
    facts = export_gguf(artifact, root / "model.gguf")
    assert facts["block_types"] == {"Q4_0": 14} and facts["exact"]
    reader = gguf.GGUFReader(str(root / "model.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.1.ffn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == "F16"
    field = reader.fields["llama.attention.head_count_kv"]
    assert int(field.parts[field.data[0]][0]) == 2
    theirs = AutoModelForCausalLM.from_pretrained(str(root), gguf_file="model.gguf", dtype=torch.float32)
    ours = load_artifact_model(artifact)
    with torch.no_grad():  # transformers undoes the q/k row permutation: the same weights, the same logits
        assert torch.equal(theirs(input_ids=IDS).logits, ours(input_ids=IDS).logits)
    tokenizer = AutoTokenizer.from_pretrained(str(root), gguf_file="model.gguf")
    _, tok = build_tiny_model("llama", seed=0)
    text = "def main(): return 1<|im_end|>"
    assert tokenizer(text)["input_ids"] == tok(text)["input_ids"]


def test_a_dense_model_is_written_in_f32_and_read_back_exactly(tmp_path):
    from transformers import AutoModelForCausalLM

    from llmopt.core.tiny import save_tiny_model

    folder = save_tiny_model(tmp_path / "dense", "llama", seed=1, rope_theta=50000.0)
    facts = export_gguf(folder, tmp_path / "dense.gguf")
    assert facts["block_types"] == {} and facts["exact"]
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="dense.gguf", dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(theirs(input_ids=IDS).logits, ours(input_ids=IDS).logits)


def test_permuted_groups_are_refused_and_nothing_is_written(artifacts):
    root, _, act = artifacts
    with pytest.raises(ArtifactError, match="act-order permuted groups"):
        export_gguf(act, root / "act.gguf")
    assert not (root / "act.gguf").exists() and not list(root.glob("*.tmp*"))


def test_cli_export_gguf(artifacts):
    root, artifact, _ = artifacts
    out = root / "cli.gguf"
    result = CliRunner().invoke(app, ["export", str(artifact), "--format", "gguf", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["architecture"] == "llama" and out.stat().st_size > 0
    again = CliRunner().invoke(app, ["export", str(artifact), "--format", "gguf", "-o", str(out)])
    assert again.exit_code == 1 and "--overwrite" in again.output


def test_llama_cpp_runs_the_export_to_our_runtime_s_greedy_tokens(tmp_path):
    """SmolLM2 RTN w4 g32 (symmetric: Q4_0, exact) in llama.cpp: the greedy tokens of llmopt's runtime on the same
    weights (a real vocabulary: llama.cpp needs BPE merges, which the tiny byte vocabulary has none of)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (built from source)")
    from llmopt.jobs.quantize import quantize_to_artifact
    from llmopt.runtime.engine.config import EngineConfig
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.engine.sampling import SamplingParams
    from llmopt.runtime.executor.loader import load_runtime_model

    artifact = tmp_path / "rtn"
    quantize_to_artifact("smollm2-135m", artifact, [make_config("rtn", bits=4, group_size=32, sym=True)])
    export_gguf(artifact, tmp_path / "rtn.gguf")
    model, tokenizer, _ = load_runtime_model(str(artifact))
    prompt = tokenizer("The capital of France is")["input_ids"]
    engine = Engine(model, tokenizer, EngineConfig())
    ours = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    llm = llama_cpp.Llama(str(tmp_path / "rtn.gguf"), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    assert llm.tokenize(b"The capital of France is", add_bos=False, special=True) == prompt
    theirs = []
    llm.eval(prompt)
    for _ in range(16):
        theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([theirs[-1]])
    assert theirs == ours
