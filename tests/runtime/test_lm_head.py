"""`--lm-head int8` (EngineConfig.lm_head): the logits head rounded to int8 per vocabulary row at load and run by
the int8 layers (8-bit inputs where the engine gives them)."""

import pytest
import torch

from llmopt.core.contract.rounding import quantize_rtn
from llmopt.core.contract import QuantScheme
from llmopt.core.errors import ConfigError
from llmopt.runtime.engine.engine import Engine, EngineConfig
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.linear.int8_cpu import Int8PackedLinear, Int8Q8Linear
from llmopt.runtime.executor.loader import load_runtime_model


def engine(path, activations, lm_head):
    checkpoint, tok, _ = load_runtime_model(str(path), activations=activations)
    return Engine(checkpoint, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, lm_head=lm_head,
                                                activations=activations))


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_the_int8_head_computes_the_rounded_weights_logits(tiny_llama_dir, activations):
    runner = engine(tiny_llama_dir, activations, "int8").runner
    decoder = runner.decoder
    head = decoder.logits_head
    # 8-bit inputs where the vocabulary is whole panels of 16 (SmolLM2's 49,152, Llama's 32,000; this tiny one's
    # 259 is not: the float int8 kernels)
    whole_panels = head.out_features % 16 == 0
    kind = Int8Q8Linear if activations == "int8" and whole_panels else Int8PackedLinear
    assert type(head) is kind and decoder._gemv_weight is None
    assert runner.linear_methods[f"lm_head: {head.name}"] == 1
    # the logits of the RTN-rounded weight (inputs rounded too with 8-bit inputs: close, not equal), at decode
    # sizes and beyond
    weight = decoder.lm_head.weight.detach()
    rounded = quantize_rtn(weight.float(), QuantScheme(8, -1, True)).dequantize(torch.float32)
    for rows in (1, 5, 40):
        hidden = torch.randn(rows, weight.shape[1])
        expected = hidden @ rounded.t()
        tol = 1e-4 if kind is Int8PackedLinear else 0.03
        torch.testing.assert_close(decoder.logits(hidden), expected, rtol=tol, atol=tol * expected.abs().max().item())
        # (and not the float head's: the rounding is there)
        assert not torch.equal(decoder.logits(hidden), hidden @ weight.float().t())


def test_generation_with_the_int8_head_stays_close_to_the_float_head(tiny_llama_dir):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 200, 31], list(range(40, 77))]
    float_head = engine(tiny_llama_dir, "float", "model").generate(prompts, params)
    int8_head = engine(tiny_llama_dir, "float", "int8").generate(prompts, params)
    # per-row int8 of a random tiny model's head: the first tokens agree (later ones may drift after a flip)
    assert [o.token_ids[:2] for o in int8_head] == [o.token_ids[:2] for o in float_head]


def test_a_model_class_without_the_int8_head_is_refused(tiny_llama_dir, monkeypatch):
    from llmopt.runtime.executor.models.llama import LlamaFamilyDecoder

    monkeypatch.setattr(LlamaFamilyDecoder, "lm_head_quantizable", False)
    with pytest.raises(ConfigError, match="--lm-head model"):
        engine(tiny_llama_dir, "float", "int8")


def test_decode_bytes_count_the_int8_heads_codes(tiny_llama_dir):
    # MBU's bytes per decode step: the int8 head's codes and scales, not the float weight (still held: tied to the
    # embedding) nor the head's other layouts of its codes
    from llmopt.eval.bench import model_cost

    float_head = engine(tiny_llama_dir, "float", "model").runner.decoder
    int8_head = engine(tiny_llama_dir, "float", "int8").runner.decoder
    weight = float_head.lm_head.weight
    head = int8_head.logits_head
    codes_and_scales = sum(t.numel() * t.element_size() for name, t in head.named_buffers()
                           if name not in head.prefill_only_buffers)
    assert model_cost(int8_head, 0).weight_bytes == (
        model_cost(float_head, 0).weight_bytes - weight.numel() * weight.element_size() + codes_and_scales)


def test_an_fp32_model_with_a_16_bit_exact_head_runs_it_through_gemv_below_the_prepacked_heads_rows():
    """The head's weight narrowed to fp16 (every value exact) and streamed by the gemv kernel with fp32 inputs (BLAS
    would multiply the fp32 copy, twice the bytes), 8 rows at a time beyond 8; from GEMV_NARROW_HEAD_ROWS rows the
    fp32 copy prepacked for oneDNN computes them (faster there), and where oneDNN is missing gemv at every count."""
    from llmopt.core.tiny import build_tiny_model
    from llmopt.runtime.executor.models.llama import GEMV_NARROW_HEAD_ROWS

    model, tok = build_tiny_model("llama", seed=0)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight.half().float())
    decoder = Engine(model, tok, EngineConfig(block_size=4, fast_path=True)).runner.decoder
    assert decoder.fused_ops is not None and decoder._gemv_weight.dtype == torch.float16
    packed = torch.backends.mkldnn.is_available()
    assert decoder.logits_head.packed == packed
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(ops, name)

        def gemv(self, x, w):
            calls.append(x.shape[0])
            return ops.gemv(x, w)

    ops, decoder.fused_ops = decoder.fused_ops, Counting()
    weight = decoder.lm_head.weight.detach().float()
    counts = (1, 2, 5, 16, 19, GEMV_NARROW_HEAD_ROWS - 1, GEMV_NARROW_HEAD_ROWS, 40)
    for rows in counts:
        hidden = torch.randn(rows, weight.shape[1])
        expected = hidden @ weight.t()
        torch.testing.assert_close(decoder.logits(hidden), expected, rtol=1e-4, atol=1e-4 * expected.abs().max())
    assert calls == [r for r in counts if r < GEMV_NARROW_HEAD_ROWS or not packed]


def test_an_fp32_head_is_prepacked_for_onednn_and_the_layers_are_not():
    """The logits head (no decode graph multiplies it) in oneDNN's blocked layout: the same logits as the plain
    weight's at every row count; the layers keep the plain fp32 layout the decode graph's kernels read."""
    from llmopt.core.tiny import build_tiny_model
    from llmopt.runtime.executor.linear.dense import FusedDenseLinear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    model, tok = build_tiny_model("llama", seed=0)
    decoder = Engine(model, tok, EngineConfig(block_size=4, fast_path=True)).runner.decoder
    head = decoder.logits_head
    assert type(head) is FusedDenseLinear and head.packed and head.row_paths() == {"blas": None}
    assert not any(getattr(m, "packed", False) for m in decoder.blocks[0].linears())
    weight = decoder.lm_head.weight.detach().float()
    for rows in (1, 3, 16, 40):
        hidden = torch.randn(rows, weight.shape[1])
        expected = hidden @ weight.t()
        torch.testing.assert_close(head(hidden), expected, rtol=1e-4, atol=1e-4 * expected.abs().max())


@pytest.fixture(scope="module")
def tiny_llama_320_dir(tmp_path_factory):
    """A tiny llama whose vocabulary (320) is whole panels of 16, as real vocabularies are."""
    from llmopt.core.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny320") / "model", vocab_size=320)


def test_the_grouped_int8_head_computes_the_rounded_weights_logits(tiny_llama_320_dir):
    from llmopt.runtime.executor.linear.int8_cpu import Int8GroupedQ8Linear
    from tests.runtime.test_cpu_kernels import q8_rounded_inputs

    runner = engine(tiny_llama_320_dir, "int8", "int8-g32").runner
    decoder = runner.decoder
    head = decoder.logits_head
    assert type(head) is Int8GroupedQ8Linear and decoder._gemv_weight is None
    assert runner.linear_methods["lm_head: int8-grouped-q8-cpu"] == 1
    weight = decoder.lm_head.weight.detach().float()
    rounded = quantize_rtn(weight, QuantScheme(8, 32, True)).dequantize(torch.float32)
    per_row = quantize_rtn(weight, QuantScheme(8, -1, True)).dequantize(torch.float32)
    # a scale per 32 columns: a finer grid than one per row (on this random head's i.i.d. rows ~0.9x the error; on
    # a real head's rows, with their outliers, far less)
    assert (rounded - weight).abs().mean() < 0.95 * (per_row - weight).abs().mean()
    for rows in (1, 5, 40):
        hidden = torch.randn(rows, weight.shape[1])
        # the 8-bit inputs times the Q8_0 weight; beyond decode sizes the plan times that kernel against the weight
        # dequantized whole (float inputs), and the path it chose there depends on the CPU and kernel build
        path = head.path_for(rows)
        assert path in ("q8", "dequantize") and (path == "q8" or rows > head.q8_only_rows)
        inputs = q8_rounded_inputs(hidden, 32) if path == "q8" else hidden.double()
        expected = inputs @ rounded.double().t()
        torch.testing.assert_close(decoder.logits(hidden).double(), expected, rtol=1e-5,
                                   atol=1e-5 * expected.abs().max().item())
    prompts = [[5, 9, 200, 31], list(range(40, 77))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    grouped = engine(tiny_llama_320_dir, "int8", "int8-g32").generate(prompts, params)
    float_head = engine(tiny_llama_320_dir, "int8", "model").generate(prompts, params)
    assert [o.token_ids[:2] for o in grouped] == [o.token_ids[:2] for o in float_head]


def test_the_grouped_int8_head_needs_8_bit_inputs(tiny_llama_320_dir):
    with pytest.raises(ConfigError, match="needs 8-bit inputs"):
        engine(tiny_llama_320_dir, "float", "int8-g32")
