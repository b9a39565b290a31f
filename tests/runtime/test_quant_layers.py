"""Packed int4 / int8 layers against the fp32 dequantize-then-matmul reference, the layout choice, and
quantized artifacts served by the runtime."""

import pytest
import torch

from llmopt.core.contract import QuantScheme
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.formats.load import load_model
from llmopt.runtime.executor.loader import load_runtime_model
from llmopt.runtime.engine.engine import Engine, EngineConfig
from llmopt.eval.hf_baseline import hf_generate
from llmopt.runtime.executor.kernels.quant_matmul import reference_quant_matmul
from llmopt.core.contract import INT8_GROUP_ACTIVATIONS, LinearScheme
from llmopt.runtime.executor.linear import make_linear as quantized_linear, select_linear_method
from llmopt.runtime.executor.linear.int4_cpu import Int4PackedLinear, Int4Q8Linear
from llmopt.runtime.executor.linear.int8_cpu import Int8GroupedQ8Linear, Int8PackedLinear, Int8Q8Linear


def packed_kind(qw, device, activations=None):
    """The registry's choice for a weight, by method name."""
    return select_linear_method(qw, LinearScheme(qw.scheme, activations), device).name
from llmopt.runtime.engine.sampling import SamplingParams


def qweight(n, k, bits, group_size, sym, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return quantize_rtn(w, QuantScheme(bits, group_size, sym), bias=b)


def reference(x, qw):
    y = reference_quant_matmul(x.float(), qw.q, qw.scales, qw.zeros, qw.g_idx)
    return y + qw.bias if qw.bias is not None else y


@pytest.mark.parametrize("n,k,bits,group_size,sym", [
    (48, 96, 4, 32, True), (48, 96, 4, 32, False), (32, 128, 4, 64, True), (16, 512, 4, 256, False),
    (64, 160, 4, -1, True),  # per channel, K = 5 x 32: the scale repeats over kernel groups
    (32, 192, 4, 96, False),  # group 96 -> kernel groups of 32
    (48, 64, 3, 32, False), (32, 64, 2, 32, True),  # narrower codes ride the int4 kernel
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_packed_matches_reference(n, k, bits, group_size, sym, dtype):
    qw = qweight(n, k, bits, group_size, sym, bias=True)
    layer = quantized_linear(qw, dtype)
    assert isinstance(layer, Int4PackedLinear)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    # the int4 kernel, the compiled dequantize-whole path, the same at prefill sizes
    for rows in (5, layer.compiled_dequantize_min_rows, layer.dequantize_min_rows):
        x = torch.randn(2, rows, k)
        y = layer(x.to(dtype))
        assert y.shape == (2, rows, n) and y.dtype == dtype
        expected = reference(x.reshape(-1, k).to(dtype), qw).reshape(2, rows, n)
        torch.testing.assert_close(y.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item())


def test_int4_dequantize_is_the_kernels_weight():
    """Dequantizing the nibble copy gives exactly what the int4 kernel multiplies by (x = identity)."""
    from llmopt.runtime.executor.kernels.quant_matmul import int4_dequantize, int4_matmul

    layer = quantized_linear(qweight(48, 192, 4, 96, False), torch.float32)
    dense = int4_dequantize(layer.nibbles, layer.scales_and_offsets, layer.kernel_group)
    through_kernel = int4_matmul(torch.eye(192), layer.packed, layer.scales_and_offsets, layer.kernel_group).t()
    torch.testing.assert_close(dense, through_kernel, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_int4_dequantization_is_bit_exact(dtype, monkeypatch):
    from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
    from llmopt.runtime.executor.linear import int4_cpu
    from llmopt.runtime.executor.kernels.quant_matmul import int4_dequantize

    layer = quantized_linear(qweight(48, 192, 4, 96, False), dtype)  # kernel groups of 32
    out = torch.empty(48, 192, dtype=dtype)
    cpu_ops().int4_dequantize_out(layer.nibbles, layer.scales_and_offsets, layer.kernel_group, out)
    expected = int4_dequantize(layer.nibbles, layer.scales_and_offsets, layer.kernel_group)
    if dtype == torch.bfloat16:  # rounded once from fp32, as the torch expression: the same bits
        assert torch.equal(out, expected)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)  # fp32: fused multiply-add vs two roundings
    # the compiled dequantization + GEMM path at 20 rows, or (no compiled kernels) aten's int4 kernel
    x = torch.randn(20, 192).to(dtype)
    compiled = layer.run_path("dequantize", x)
    torch.testing.assert_close(compiled, torch.nn.functional.linear(x, out), rtol=0, atol=0)
    monkeypatch.setattr(int4_cpu, "cpu_ops", lambda: None)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(layer(x).float(), compiled.float(), rtol=tol, atol=tol * compiled.abs().max().item())


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_packed_matches_reference(sym, dtype):
    qw = qweight(40, 80, 8, -1, sym, bias=True)
    layer = quantized_linear(qw, dtype)
    assert isinstance(layer, Int8PackedLinear)
    assert (layer.correction is None) == sym  # symmetric codes need no zero-point correction
    x = torch.randn(7, 80)
    expected = reference(x.to(dtype), qw)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(layer(x.to(dtype)).float(), expected.float(), rtol=tol,
                               atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("bits,group_size,sym,kind", [(4, 32, True, Int4PackedLinear), (4, 32, False, Int4PackedLinear),
                                                      (8, -1, True, Int8PackedLinear), (8, -1, False, Int8PackedLinear)])
def test_stacked_packed_linears_equal_their_parts_side_by_side(bits, group_size, sym, kind):
    """q/k/v and gate/up run as one kernel call: the same outputs as each part alone, concatenated."""
    from llmopt.runtime.executor.linear import fuse_linears

    parts = [quantized_linear(qweight(n, 96, bits, group_size, sym, seed=n, bias=n == 32), torch.bfloat16)
             for n in (48, 16, 32)]
    fused = fuse_linears(parts, prepack=True)
    assert type(fused) is kind and fused.out_features == 96
    for rows in (3, 20, Int4PackedLinear.dequantize_min_rows):  # int4: the kernel, then the dequantize-whole paths
        x = torch.randn(rows, 96).bfloat16()
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=0, atol=0)
    # The exact path keeps each part as it is.
    assert type(fuse_linears(parts, prepack=False)).__name__ == "ConcatLinears"


def test_layout_choice_falls_back_to_dense_where_no_kernel_fits():
    assert packed_kind(qweight(32, 64, 4, 32, True), "cpu") == "int4-cpu"
    assert packed_kind(qweight(32, 64, 8, -1, True), "cpu") == "int8-cpu"
    assert packed_kind(qweight(32, 128, 4, 64, True), "cpu", INT8_GROUP_ACTIVATIONS) == "int4-q8-cpu"
    assert packed_kind(qweight(32, 64, 4, 32, True), "cpu", INT8_GROUP_ACTIVATIONS) == "int4-q8-cpu"
    assert packed_kind(qweight(32, 64, 8, -1, True), "cpu", INT8_GROUP_ACTIVATIONS) == "int8-q8-cpu"
    # N not a multiple of 16: no 8-bit inputs' layout; make_linear runs the float int8 layer (not dequantized)
    assert type(quantized_linear(qweight(40, 64, 8, -1, True), torch.float32, "cpu", INT8_GROUP_ACTIVATIONS)
                ) is Int8PackedLinear
    huge = qweight(32, 64, 4, 32, True)
    huge.scales = huge.scales * 1e6  # beyond float16, where the 8-bit inputs' kernel keeps its scales
    assert packed_kind(huge, "cpu", INT8_GROUP_ACTIVATIONS) == "dense"
    # ... which make_linear then runs with float inputs rather than dequantized
    assert type(quantized_linear(huge, torch.float32, "cpu", INT8_GROUP_ACTIVATIONS)) is Int4PackedLinear
    assert packed_kind(qweight(40, 64, 4, 32, True), "cpu") == "dense"  # N not a multiple of 16
    assert packed_kind(qweight(32, 64, 4, 16, True), "cpu") == "dense"  # group 16: no kernel group
    assert packed_kind(qweight(32, 64, 8, 32, True), "cpu") == "dense"  # grouped int8
    assert packed_kind(qweight(32, 72, 8, -1, True), "cpu") == "dense"  # K not a multiple of 16
    assert packed_kind(qweight(32, 64, 4, 32, True), "meta") == "dense"  # not CPU
    permuted = qweight(32, 64, 4, 32, True)
    permuted.g_idx = permuted.g_idx.flip(0)  # act-order with permuted groups
    assert packed_kind(permuted, "cpu") == "dense"
    dense = quantized_linear(permuted, torch.float32)
    x = torch.randn(3, 64)
    torch.testing.assert_close(dense(x), reference(x, permuted), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def gptq_artifact(tiny_gptq_artifact):
    return tiny_gptq_artifact


def test_artifact_with_packed_kernels_matches_dequantized(gptq_artifact):
    dense, tok, _ = load_model(str(gptq_artifact))
    # transformers over the packed layers (formats.load's factory) against transformers over dequantized weights
    packed, _, _ = load_model(str(gptq_artifact), linear_factory=quantized_linear)
    kinds = {type(m).__name__ for m in packed.modules()}
    assert "Int4PackedLinear" in kinds
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids=ids).logits, dense(input_ids=ids).logits, rtol=1e-3, atol=1e-3)
    # the runtime, loading the artifact by itself (no transformers model), reproduces transformers over the same
    # packed layers
    checkpoint, _, _ = load_runtime_model(str(gptq_artifact))
    assert "Int4PackedLinear" in {type(m).__name__ for m in checkpoint.modules()}
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ps = [[5, 9, 200, 31], list(range(40, 77))]
    expected = [hf_generate(packed, tok, [p], params)[0] for p in ps]
    for model in (checkpoint, packed):
        outputs = Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20)).generate(ps, params)
        assert [o.token_ids for o in outputs] == expected


def test_decode_bytes_count_the_int4_kernel_weights_not_the_prefill_copy(gptq_artifact):
    """MBU's bytes per decode step: int4 linears count one copy of their codes and scales, not the other
    layouts of the same codes (the nibbles, the panels) a step reads instead."""
    from llmopt.eval.bench import model_cost

    checkpoint, tok, _ = load_runtime_model(str(gptq_artifact))
    decoder = Engine(checkpoint, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20)).runner.decoder
    int4 = [m for m in decoder.blocks.modules() if isinstance(m, Int4PackedLinear)]
    assert int4
    nibble_bytes = sum(m.nibbles.numel() + m.panel_codes.numel() + 4 * m.panel_scales.numel() for m in int4)
    everything = sum(t.numel() * t.element_size() for t in list(decoder.blocks.parameters())
                     + list(decoder.blocks.buffers()))
    lm_head = decoder.lm_head.weight
    assert model_cost(decoder, 0).weight_bytes == (
        everything - nibble_bytes + lm_head.numel() * lm_head.element_size())


@pytest.fixture
def kernel_calls(monkeypatch):
    """The names of the compiled ops the runtime's layers call, in order."""
    from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
    from llmopt.runtime.executor.linear import int4_cpu, int8_cpu

    ops = cpu_ops()
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ops, name)

    monkeypatch.setattr(int4_cpu, "cpu_ops", lambda: Spy())
    monkeypatch.setattr(int8_cpu, "cpu_ops", lambda: Spy())
    return calls


@pytest.mark.parametrize("rows,kernel", [(1, "int4_matmul_rows"), (3, "int4_matmul_panels"), (40, "int4_matmul_tiled")])
def test_fp32_int4_decode_rows_run_from_the_codes(rows, kernel, kernel_calls):
    # by default fp32 activations go to the compiled kernels, few rows straight from the codes, more tile by tile
    # (aten's int4 kernel is ~20x slower with fp32 inputs); bf16 keeps aten's
    calls = kernel_calls
    qw = qweight(48, 192, 4, 64, False)
    layer = quantized_linear(qw, torch.float32)
    x = torch.randn(rows, 192)
    torch.testing.assert_close(layer(x), reference(x, qw), rtol=1e-5, atol=1e-5 * reference(x, qw).abs().max().item())
    assert calls == [kernel]
    calls.clear()
    quantized_linear(qw, torch.bfloat16)(x.bfloat16())
    assert "int4_matmul_rows" not in calls


def test_int8_activations_are_a_scheme(kernel_calls):
    calls = kernel_calls
    qw = qweight(48, 192, 4, 64, True)
    layer = quantized_linear(qw, torch.float32)
    x = torch.randn(2, 192)
    exact = layer(x)
    q8 = quantized_linear(qw, torch.float32, "cpu", INT8_GROUP_ACTIVATIONS)
    assert type(q8) is Int4Q8Linear and type(layer) is Int4PackedLinear
    approx = q8(x)
    assert calls == ["int4_matmul_panels", "int4_matmul_q8"]
    # 8-bit inputs: close to the exact product, not equal to it
    assert not torch.equal(approx, exact)
    torch.testing.assert_close(approx, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())


def test_at_decode_sizes_the_8_bit_inputs_layer_times_only_its_8_bit_kernels():
    # up to q8_only_rows the plan may choose between the VNNI and the AMX kernel (the same numbers bit for bit), never
    # a float path (other numbers); beyond, every path is timed
    from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops

    layer = quantized_linear(qweight(48, 192, 4, 64, False), torch.bfloat16, "cpu", INT8_GROUP_ACTIVATIONS)
    paths = layer.row_paths()
    assert ("q8_amx" in paths) == cpu_ops().amx_int8()
    eight_bit = {"q8", "q8_amx"} & set(paths)
    assert set(layer.candidate_paths(layer.q8_only_rows, paths)) == eight_bit
    beyond = set(layer.candidate_paths(layer.q8_only_rows + 1, paths))
    assert eight_bit < beyond and "dequantize" in beyond


def int8_with_8_bit_inputs_reference(x, qw, block=32):
    """The dequantized int8 weight times the inputs rounded to int8 per row and block of 32, in float64."""
    from tests.runtime.test_cpu_kernels import q8_rounded_inputs

    g = qw.g_idx.long()  # (a scale per row or per group of columns)
    y = q8_rounded_inputs(x, block) @ (qw.scales.double()[:, g] * (qw.q.double() - qw.zeros.double()[:, g])).t()
    return y + qw.bias.double() if qw.bias is not None else y


def assert_decode_rows_run_the_8_bit_kernel(layer, qw, dtype, kernel_calls, row_counts):
    """At each decode row count the layer calls int8_matmul_q8 alone and computes the rounded inputs' product;
    only the 8-bit kernel is a candidate there."""
    k = qw.shape[1]
    for rows in row_counts:
        x = torch.randn(rows, k).to(dtype)
        kernel_calls.clear()
        y = layer(x)
        assert kernel_calls == ["int8_matmul_q8"], rows
        expected = int8_with_8_bit_inputs_reference(x, qw)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    assert layer.candidate_paths(layer.q8_only_rows, layer.row_paths()) == ["q8"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weights_with_8_bit_inputs_multiply_integers(dtype, kernel_calls):
    # the engine's int8 inputs (the CPU default) reach int8 weight-only layers too: the 8-bit kernel at decode
    # sizes (the float paths compute other numbers: never candidates there), every path timed beyond
    qw = qweight(48, 192, 8, -1, True, bias=True)
    layer = quantized_linear(qw, dtype, "cpu", INT8_GROUP_ACTIVATIONS)
    assert type(layer) is Int8Q8Linear and type(quantized_linear(qw, dtype)) is Int8PackedLinear
    assert_decode_rows_run_the_8_bit_kernel(layer, qw, dtype, kernel_calls, (1, 3, 8, 9, 16))
    paths = layer.row_paths()
    assert {"q8", "tiled", "dequantize"} <= set(layer.candidate_paths(layer.q8_only_rows + 1, paths))
    x = torch.randn(64, 192).to(dtype)  # every path beyond decode: close to the exact product
    exact = reference(x.float(), qw)
    for name in paths:
        torch.testing.assert_close(layer.run_path(name, x).float(), exact, rtol=0.05,
                                   atol=0.05 * exact.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
def test_grouped_int8_weights_with_8_bit_inputs_multiply_integers(dtype, group, kernel_calls):
    # symmetric 8-bit groups (GPTQ's bits=8 group_size=128, a Q8_0-style head) run the integer kernel with their
    # grouped scales; without 8-bit inputs, or with zero points off 128, they stay dequantized (as before)
    qw = qweight(48, 192, 8, group, True, bias=True)
    layer = quantized_linear(qw, dtype, "cpu", INT8_GROUP_ACTIVATIONS)
    assert type(layer) is Int8GroupedQ8Linear
    assert packed_kind(qw, "cpu") == "dense"
    assert packed_kind(qweight(48, 192, 8, group, False), "cpu", INT8_GROUP_ACTIVATIONS) == "dense"
    assert_decode_rows_run_the_8_bit_kernel(layer, qw, dtype, kernel_calls, (1, 3, 16))
    paths = layer.row_paths()
    assert set(layer.candidate_paths(layer.q8_only_rows + 1, paths)) == {"q8", "dequantize"}
    x = torch.randn(64, 192).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    exact = reference(x.float(), qw) - qw.bias  # the dequantized path: the exact product (the bias is forward's)
    torch.testing.assert_close(layer.run_path("dequantize", x).float(), exact, rtol=tol,
                               atol=tol * exact.abs().max().item())
    assert layer.graph_call(1)[0] == "int8_matmul_q8"


def test_stacked_grouped_int8_layers_equal_their_parts():
    from llmopt.runtime.executor.linear import fuse_linears

    parts = [quantized_linear(qweight(n, 128, 8, 32, True, seed=n), torch.float32, "cpu", INT8_GROUP_ACTIVATIONS)
             for n in (48, 16, 32)]
    fused = fuse_linears(parts, prepack=True)
    assert type(fused) is Int8GroupedQ8Linear and fused.out_features == 96
    for rows in (1, 3, 20):
        x = torch.randn(rows, 128)
        for path in ("q8", "dequantize"):
            torch.testing.assert_close(fused.run_path(path, x), torch.cat([p.run_path(path, x) for p in parts], -1),
                                       rtol=0, atol=0)


def test_stacked_int8_layers_with_8_bit_inputs_equal_their_parts():
    # exact: each output column is computed on its own, and the inputs' scales do not depend on the weights; a
    # zero point on one part only gives the others a zero shift
    from llmopt.runtime.executor.linear import fuse_linears

    parts = [quantized_linear(qweight(n, 96, 8, -1, sym, seed=n), torch.float32, "cpu", INT8_GROUP_ACTIVATIONS)
             for n, sym in ((48, True), (16, False), (32, True))]
    assert all(type(p) is Int8Q8Linear for p in parts) and parts[1].q8_shift is not None
    fused = fuse_linears(parts, prepack=True)
    assert type(fused) is Int8Q8Linear and fused.out_features == 96
    for rows in (1, 3, 20):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(fused.run_path("q8", x), torch.cat([p.run_path("q8", x) for p in parts], -1),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("method_cls", [Int4PackedLinear, Int8PackedLinear])
def test_shards_along_out_and_in_features_rebuild_the_whole_product(method_cls):
    """The sharding hook tensor parallelism will use: each rank's method, built from its share of the weight,
    computes its slice of the outputs (column-parallel: concatenated) or a partial sum (row-parallel: added)."""
    bits, group = (4, 32) if method_cls is Int4PackedLinear else (8, -1)
    qw = qweight(64, 128, bits, group, True, bias=True)
    x = torch.randn(3, 128)
    whole = method_cls(qw, torch.float32)(x)
    columns = [method_cls(method_cls.shard_weight(qw, "out", r, 2), torch.float32)(x) for r in range(2)]
    torch.testing.assert_close(torch.cat(columns, dim=-1), whole, rtol=1e-5, atol=1e-5)
    # (one group per row: each share keeps the row's scale)
    rows = [method_cls(method_cls.shard_weight(qw, "in", r, 2), torch.float32)(x[:, r * 64:(r + 1) * 64])
            for r in range(2)]
    torch.testing.assert_close(rows[0] + rows[1], whole, rtol=1e-4, atol=1e-4)


def test_a_cut_inside_a_group_or_across_permuted_groups_is_refused():
    from llmopt.core.errors import ConfigError

    qw = qweight(64, 128, 4, 32, True)
    with pytest.raises(ConfigError, match="whole groups of 32"):
        qw.narrow_columns(0, 48, keep_bias=True)
    qw.g_idx = qw.g_idx.flip(0)  # act-order: groups permuted
    with pytest.raises(ConfigError, match="act-order"):
        qw.narrow_columns(0, 64, keep_bias=True)


def test_the_scheme_presets_choose_their_methods():
    from llmopt.core.contract import preset
    from llmopt.core.errors import ConfigError

    for name, bits, group, expected in (("w4a16", 4, 128, "int4-cpu"), ("w8a16", 8, -1, "int8-cpu"),
                                        ("w4a8", 4, 128, "int4-q8-cpu")):
        scheme = preset(name)
        assert (scheme.weights.bits, scheme.weights.group_size) == (bits, group)
        qw = qweight(32, 256, bits, group, True)
        assert select_linear_method(qw, scheme, "cpu").name == expected, name
    with pytest.raises(ConfigError, match="unknown scheme 'w3a3'"):
        preset("w3a3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("acts", [None, INT8_GROUP_ACTIVATIONS])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_plans_bound_kernel_calls_compute_what_the_paths_do(dtype, acts, bits):
    # set_row_plan binds each chosen path's kernel with its weights (`_bind_<path>`); forward_2d (the fast path's
    # call) runs them: the same bits as the path methods, at every row count
    from llmopt.runtime.executor.linear.kernel_plans import ROW_BUCKETS, RowPlan, fixed_plan

    layer = quantized_linear(qweight(48, 192, bits, 64 if bits == 4 else -1, False), dtype, "cpu", acts)
    layer.set_row_plan(fixed_plan(layer))
    run = layer.forward_2d()
    for rows in (1, 3, 16, 40):
        x = torch.randn(rows, 192).to(dtype)
        assert torch.equal(run(x), layer.run_path(layer.default_path(rows), x)), rows
        assert torch.equal(run(x), layer(x)), rows
    for name in layer.row_paths():  # every path a measured plan may choose here (q8_amx where the CPU has AMX)
        layer.set_row_plan(RowPlan({b: name for b in ROW_BUCKETS}))
        run = layer.forward_2d()
        for rows in (1, 17):
            x = torch.randn(rows, 192).to(dtype)
            assert torch.equal(run(x), layer.run_path(name, x)), (name, rows)


def test_a_grouped_8_bit_artifact_runs_integer_dots_through_the_runtime(tiny_llama_dir, tmp_path):
    # `llmopt quantize --bits 8 --group-size 32` (symmetric, GPTQ's bits=8 with groups): with 8-bit inputs every
    # decoder linear runs int8-grouped-q8-cpu, and the engine scores a prompt as the artifact's dequantized weights
    # do (float inputs: the dense method) within the inputs' 8-bit rounding. (Scored, not generated: this random
    # model's next tokens are near-ties that the rounding may flip.)
    from llmopt.compress.api import make_config
    from llmopt.jobs.quantize import quantize_to_artifact

    artifact = tmp_path / "w8g32"
    quantize_to_artifact(str(tiny_llama_dir), artifact, [make_config("rtn", bits=8, group_size=32, sym=True)],
                         overwrite=True)
    prompt = list(range(40, 77))
    scores = {}
    for activations in ("int8", "float"):
        checkpoint, tok, _ = load_runtime_model(str(artifact), activations=activations)
        # (chunks of 16 rows: every row through the 8-bit kernel, which serves up to 16 rows whatever the plan)
        engine = Engine(checkpoint, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, activations=activations,
                                                      max_num_batched_tokens=16))
        methods = engine.runner.linear_methods
        grouped = methods.get("int8-grouped-q8-cpu", 0)
        assert (grouped == 2 * 7) == (activations == "int8"), methods  # q, k, v, o, gate, up, down per layer
        out = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        scores[activations] = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])]
    fast, exact = torch.tensor(scores["int8"]), torch.tensor(scores["float"])
    # (measured: 0.025 at most, 0.0095 on average; with the two groups' scales swapped 0.96 at most)
    assert (fast - exact).abs().max() < 0.06 and (fast - exact).abs().mean() < 0.02 and not torch.equal(fast, exact)
