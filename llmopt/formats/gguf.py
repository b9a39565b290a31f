"""GGUF export: an artifact's quantized codes written into the GGUF block types that hold them (llama.cpp's
format, written with the `gguf` package), with the tokenizer and chat template as llama.cpp reads them.

Block types (32 values per block, an fp16 scale `d` per block; ggml's layouts):
- Q4_0: 18 bytes, w = d (q - 8), byte j of the 16 holds q[j] (low nibble) and q[j + 16] (high nibble);
- Q4_1: 20 bytes, w = d q + m, an fp16 minimum `m` after d, nibbles as Q4_0;
- Q8_0: 34 bytes, w = d x with x int8.
Our codes hold exactly: symmetric 4-bit (zero point 8) as Q4_0 and symmetric 8-bit (zero point 128) as Q8_0, for
groups of a multiple of 32 columns (or one per row) whose scales are fp16 values (every artifact stores them so).
Asymmetric 4-bit goes to Q4_1 with m = -z d rounded to fp16: for a float zero point the same fp16 d and m (its
quantizer rounds m to fp16 first, core.contract.int_grid.float_zero_qparams), so only fp32 rounding parts d q + m from
d (q - z); for an integer one the closest block type. The largest error is reported either way.
Everything else is refused with the reason (act-order permuted groups, groups under 32, 2/3-bit, asymmetric 8-bit,
float codes). Dense tensors: 1-D ones (norms) in F32, the rest (embedding, lm_head) in F16 as artifacts store them;
a dense model (no quantized linears) keeps fp32 weights in F32 (llama.cpp's own quantizer starts from such a file).

llama.cpp's Llama applies rotary embeddings to interleaved pairs where transformers rotates halves: like its own
converter, q_proj's and k_proj's rows are permuted per head ([2, D/2] -> [D/2, 2]), codes, scales and zero points
alike (a row permutation keeps every block whole)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from llmopt.core.contract import QuantizedWeight
from llmopt.core.errors import ArtifactError
from llmopt.core.io import atomic_output_file, check_not_inside, check_output_file, short_writes_as_full_disk

BLOCK = 32
ARCHITECTURES = {"llama": "llama", "mistral": "llama"}  # model_type -> GGUF architecture
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`."""
    module, _, kind = hf_name.rpartition(".")
    if module in TOP_NAMES:
        return f"{TOP_NAMES[module]}.{kind}"
    parts = module.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in LAYER_NAMES:
        return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:])]}.{kind}"
    raise ArtifactError(f"{hf_name}: no GGUF name for this tensor (llama.cpp's Llama has none)")


def rope_permutation(rows: int, heads: int) -> torch.Tensor:
    """Row order that turns transformers' rotate-half layout of a q/k projection into llama.cpp's pairs."""
    head_dim = rows // heads
    return torch.arange(rows).view(heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)


def block_type(qweight: QuantizedWeight, name: str) -> str:
    """The GGUF block type that holds `qweight` ("Q4_0", "Q4_1", "Q8_0"), or ArtifactError naming why none."""
    scheme, k = qweight.scheme, qweight.shape[1]
    group = k if scheme.group_size == -1 else scheme.group_size
    if scheme.type != "int":
        raise ArtifactError(f"{name}: {scheme.bits}-bit float codes have no exact GGUF block type here: export an "
                            "integer artifact (rtn / gptq / awq)")
    if not qweight.has_trivial_g_idx:
        raise ArtifactError(f"{name}: act-order permuted groups (GGUF blocks are 32 consecutive columns): quantize "
                            "with --static-groups")
    if group % BLOCK or k % BLOCK:
        raise ArtifactError(f"{name}: groups of {group} columns (K = {k}) do not cover whole 32-value GGUF blocks: "
                            "quantize with --group-size 32, 64 or 128")
    zeros = qweight.zeros
    if scheme.bits == 4:
        return "Q4_0" if bool((zeros == 8).all()) else "Q4_1"
    if scheme.bits == 8 and bool((zeros == 128).all()):
        return "Q8_0"
    kind = "asymmetric 8-bit" if scheme.bits == 8 else f"{scheme.bits}-bit"
    raise ArtifactError(f"{name}: {kind} codes have no exact GGUF block type (Q4_0 / Q4_1 / Q8_0): quantize with "
                        "--bits 4, or --bits 8 --sym")


def _block_groups(qweight: QuantizedWeight) -> torch.Tensor:
    """[K / 32] the group of each block (of its first column: block_type checked that a block is one group)."""
    return qweight.g_idx.long().view(-1, BLOCK)[:, 0]


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, B, 32] codes 0..15 -> [N, B, 16] bytes: value j low, value j + 16 high."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def encode_blocks(qweight: QuantizedWeight, kind: str) -> np.ndarray:
    """[N, K / 32 x block bytes] uint8, the rows of `qweight` in GGUF block type `kind`."""
    n, k = qweight.shape
    groups = _block_groups(qweight)
    scales = qweight.scales[:, groups]  # [N, B]
    parts = [scales.to(torch.float16).contiguous().view(torch.uint8).view(n, k // BLOCK, 2)]
    codes = qweight.q.view(n, k // BLOCK, BLOCK)
    if kind == "Q4_1":
        m = (-qweight.zeros.float()[:, groups] * scales).to(torch.float16)  # [N, B]
        parts += [m.contiguous().view(torch.uint8).view(n, k // BLOCK, 2)]
    if kind in ("Q4_0", "Q4_1"):
        parts.append(_nibbles(codes))
    else:  # Q8_0
        parts.append((codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(n, -1).numpy()


def decode_blocks(data: np.ndarray, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    """The fp32 weight [N, K] a GGUF reader computes from blocks (the `gguf` package's own dequantizer)."""
    import gguf

    values = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, kind))
    return torch.from_numpy(np.ascontiguousarray(values)).view(shape)


def _tokenizer_metadata(writer, tokenizer, config: dict) -> None:
    """The vocabulary, merges, special tokens and chat template as llama.cpp's BPE (`gpt2`) tokenizer reads them."""
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str()) if tokenizer.is_fast else {}
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ArtifactError("GGUF export writes byte-level BPE tokenizers (GPT-2 style, as SmolLM2's); this one is "
                            f"{model.get('type') or type(tokenizer).__name__}")
    size = int(config["vocab_size"])
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    tokens, types = [], []
    for i in range(size):
        token = by_id.get(i)
        tokens.append(token if token is not None else f"[PAD{i}]")
        types.append(gguf.TokenType.CONTROL if i in special else
                     gguf.TokenType.UNUSED if token is None else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    else:  # a vocabulary of single bytes (a test's): GGUF has no empty arrays, so the key is left out; transformers
        # then derives merges from scores, which must be there (llama.cpp refuses a BPE vocabulary without merges)
        writer.add_token_scores([0.0] * size)
    for attribute, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                           ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(tokenizer, attribute, None)
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for how text is split before BPE: GPT-2's regex for a byte-level pre-tokenizer that uses
    it (SmolLM2's as llmopt reads it), else llama.cpp's default split."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return "default"


def _model_metadata(writer, config: dict, file_type) -> None:
    heads = int(config["num_attention_heads"])
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_rope_dimension_count(int(config.get("head_dim") or config["hidden_size"] // heads))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)


def rope_theta(config: dict) -> float:
    """The rotary base, where transformers keeps it (rope_parameters; older configs: rope_theta)."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def check_exportable(config: dict) -> str:
    """The GGUF architecture of an artifact's config, or ArtifactError saying why it has none here."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ArtifactError(f"GGUF export writes Llama-family models ({', '.join(ARCHITECTURES)}); "
                            f"{model_type!r} is not one")
    rope_type = (config.get("rope_parameters") or config.get("rope_scaling") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ArtifactError(f"GGUF export does not write {rope_type!r} rotary scaling (llama.cpp takes it as a "
                            "rope_freqs tensor and scaling keys): not supported yet")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ArtifactError("GGUF export writes bias-free Llama layers")
    return ARCHITECTURES[model_type]


def export_gguf(source: str | Path, output: str | Path, overwrite: bool = False,
                trust_remote_code: bool = False) -> dict:
    """Write ARTIFACT (its quantized linears' codes, its dense tensors, its tokenizer) as one GGUF file; a dense
    model folder is written with its weights as stored (fp32: F32, else F16)."""
    import gguf

    from llmopt.core.models import load_tokenizer, resolve_model
    from llmopt.formats.read import read_artifact

    start = time.perf_counter()
    source, output = Path(source), check_output_file(output, "GGUF file")
    check_not_inside(output, source, "input artifact")  # (a file inside it would change the artifact)
    if output.exists() and not overwrite:
        raise ArtifactError(f"{output} exists: give --overwrite to replace it")
    if not (source / "config.json").exists():
        raise ArtifactError(f"{source} is not a model folder (no config.json)")
    contents = read_artifact(source)
    config = contents.config
    arch = check_exportable(config)
    kinds = {name: block_type(qw, name) for name, qw in contents.qweights.items()}  # refuse before writing
    tokenizer = load_tokenizer(resolve_model(str(source)), trust_remote_code=trust_remote_code)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    counts = {kind: list(kinds.values()).count(kind) for kind in set(kinds.values())}
    linears = [t for n, t in contents.dense.items() if t.dim() == 2 and "layers." in n]
    dense_type = "F32" if any(t.dtype == torch.float32 for t in linears) else "F16"
    main = max(counts, key=counts.get) if counts else dense_type  # a dense model: its linears as stored
    file_type = {"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                 "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "F32": gguf.LlamaFileType.ALL_F32}[main]
    max_error = 0.0
    with atomic_output_file(output) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_name(config.get("_name_or_path") or source.name)
        _model_metadata(writer, config, file_type)
        _tokenizer_metadata(writer, tokenizer, config)
        for name, qweight in contents.qweights.items():
            rows = _rope_rows(name, qweight.shape[0], heads, kv_heads)
            if rows is not None:
                qweight = _rows(qweight, rows)
            data = encode_blocks(qweight, kinds[name])
            max_error = max(max_error, float((decode_blocks(data, kinds[name], qweight.shape)
                                              - qweight.dequantize()).abs().max()))
            writer.add_tensor(gguf_name(f"{name}.weight"), data,
                              raw_dtype=getattr(gguf.GGMLQuantizationType, kinds[name]))
        tied = bool(config.get("tie_word_embeddings"))
        for name, tensor in contents.dense.items():
            if tied and name == "lm_head.weight":
                continue
            rows = _rope_rows(name.rpartition(".")[0], tensor.shape[0], heads, kv_heads)
            tensor = tensor[rows] if rows is not None else tensor
            wide = tensor.dim() == 1 or (tensor.dtype == torch.float32 and not contents.qweights)
            array = tensor.float().numpy() if wide else tensor.to(torch.float16).numpy()
            writer.add_tensor(gguf_name(name), array)
        with short_writes_as_full_disk(tmp):
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
    return {"output": str(output), "format": "gguf", "architecture": arch,
            "block_types": dict(sorted(counts.items())), "exact": max_error == 0.0,
            "max_abs_error": max_error, "gguf_bytes": output.stat().st_size,
            "wall_s": round(time.perf_counter() - start, 2)}


def _rope_rows(module: str, rows: int, heads: int, kv_heads: int) -> torch.Tensor | None:
    """The permutation of q_proj's / k_proj's rows for llama.cpp (None for other modules)."""
    leaf = module.rsplit(".", 1)[-1]
    if leaf == "q_proj":
        return rope_permutation(rows, heads)
    if leaf == "k_proj":
        return rope_permutation(rows, kv_heads)
    return None


def _rows(qweight: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    """`qweight` with its rows (codes, scales, zero points, bias) in `order`."""
    from dataclasses import replace

    bias = qweight.bias[order] if qweight.bias is not None else None
    return replace(qweight, q=qweight.q[order].contiguous(), scales=qweight.scales[order].contiguous(),
                   zeros=qweight.zeros[order].contiguous(), bias=bias)
