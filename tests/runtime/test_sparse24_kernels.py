"""The sparse linear methods (runtime/executor/linear/sparse24_cpu.py: 2:4 values; sparse24_int4_cpu.py: 2:4 int4
codes; sparse_bitmask_cpu.py: unstructured) and their compiled kernels (kernels/csrc/sparse24_cpu.cpp,
sparse_bitmask_cpu.cpp) against the dense weight with zeros in place, in every kernel build this CPU runs (scalar,
avx2, avx512, avx512_bf16), at 1, 3, 8 and 512 rows (decode, speculative verification, prefill)."""

import pytest
import torch
import torch.nn.functional as F

from llmopt.core.contract.sparse24 import Sparse24Weight
from llmopt.core.contract.sparse_bitmask import BitmaskWeight
from llmopt.core.hardware import supported_kernel_isas
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.linear import make_linear
from llmopt.runtime.executor.linear.dense import fuse_linears
from llmopt.runtime.executor.linear.kernel_plans import measure_plan
from llmopt.runtime.executor.linear.sparse24_cpu import Sparse24Linear


def sparse_2of4(n: int, k: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """[N, K] with exactly two non-zeros in every group of 4 columns, at random places."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, k // 4, 4, generator=g).argsort(-1)[..., :2]
    mask = torch.zeros(n, k // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(n, k)
    return (torch.randn(n, k, generator=g) * mask).to(dtype)


@pytest.fixture(params=supported_kernel_isas())
def ops(request):
    built = cpu_ops(request.param)
    assert built is not None, f"the {request.param} kernels failed to build"
    return built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (fp16 differs only in load/store conversions)
@pytest.mark.parametrize("n,k", [(48, 64), (37, 576), (96, 1536)])  # odd N: the one-output tail
@pytest.mark.parametrize("rows", [1, 3, 8, 512])
def test_kernels_match_the_dense_weight(ops, dtype, n, k, rows):
    weight = sparse_2of4(n, k, seed=n + k, dtype=dtype)
    stored = Sparse24Weight.from_dense(weight)
    values, positions, bitmask = stored.values, stored.positions_2of4(), stored.bitmask
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = x.double() @ weight.double().T
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = expected.abs().max().item()
    for name, out in (("rows", ops.sparse24_matmul_rows(x, values, positions)),
                      ("tiled", ops.sparse24_matmul_tiled(x, values, positions, bitmask, 64 << 10))):
        assert out.dtype == dtype and out.shape == (rows, n), name
        assert (out.double() - expected).abs().max().item() <= tol * scale, name
    dense = torch.empty(n, k, dtype=dtype)
    ops.sparse24_decompress_out(values, positions, bitmask, dense)
    assert torch.equal(dense, weight)


@pytest.mark.parametrize("compiled", [True, False])
def test_every_path_of_the_method_matches_the_dense_linear(monkeypatch, compiled):
    if not compiled:
        monkeypatch.setenv("LLMOPT_CPU_KERNELS", "0")
        cpu_ops.cache_clear()
    try:
        weight, bias = sparse_2of4(80, 128, seed=3), torch.randn(80)
        layer = make_linear(Sparse24Weight.from_dense(weight, bias=bias), torch.float32)
        assert isinstance(layer, Sparse24Linear)
        assert torch.equal(layer.dense_weight(), weight)
        x = torch.randn(9, 128)
        expected = F.linear(x, weight, bias)
        for path in layer.row_paths():
            torch.testing.assert_close(layer.run_path(path, x) + bias, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
        plan, times = measure_plan(layer, buckets=(1, 16))
        paths = set(layer.row_paths())  # (one path: nothing to time)
        assert set(times[1]) == (paths if len(paths) > 1 else set()) and plan.path(1) in paths
    finally:
        cpu_ops.cache_clear()


def test_stacked_parts_equal_each_part():
    parts = [make_linear(Sparse24Weight.from_dense(sparse_2of4(n, 64, seed=n)), torch.float32) for n in (64, 32, 32)]
    fused = fuse_linears(parts, prepack=True)
    assert isinstance(fused, Sparse24Linear) and fused.out_features == 128
    x = torch.randn(3, 64)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=0, atol=0)


def test_weights_the_kernels_cannot_hold_run_dense():
    """4:8 (positions of 3 bits) and in_features that are no multiple of 32: the dense fallback, decompressed."""
    from llmopt.runtime.executor.linear.dense import DequantizedLinear

    weight = sparse_2of4(16, 64, seed=1).reshape(16, 8, 8)[..., [0, 1, 4, 5, 2, 3, 6, 7]].reshape(16, 64)
    four_of_eight = Sparse24Weight.from_dense(weight, "4:8")
    narrow = Sparse24Weight.from_dense(sparse_2of4(16, 48, seed=2))
    for stored in (four_of_eight, narrow):
        layer = make_linear(stored, torch.float32)
        assert isinstance(layer, torch.nn.Linear) and DequantizedLinear.accepts(stored, None, torch.device("cpu"))
        assert torch.equal(layer.weight, stored.decompress())


def quantized_2of4(n: int, k: int, group: int, seed: int = 0, sym: bool = True):
    """A 4-bit QuantizedWeight [N, K] whose pruned codes (two of every 4 columns) sit at the zero point, marked
    compressed (keep)."""
    from llmopt.core.contract import QuantizedWeight, QuantScheme, default_g_idx
    from llmopt.core.contract.sparse24 import pack_mask

    g = torch.Generator().manual_seed(seed)
    scheme = QuantScheme(4, group, sym)
    groups = scheme.num_groups(k)
    scales = torch.rand(n, groups, generator=g) * 0.1 + 0.01
    zeros = torch.full((n, groups), 8, dtype=torch.int32) if sym else torch.randint(0, 16, (n, groups), generator=g,
                                                                                      dtype=torch.int32)
    mask = sparse_2of4(n, k, seed=seed) != 0
    g_idx = default_g_idx(k, scheme)
    q = torch.where(mask, torch.randint(0, 16, (n, k), generator=g), zeros[:, g_idx.long()]).to(torch.uint8)
    return QuantizedWeight(q, scales, zeros, g_idx, scheme, keep=pack_mask(mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(48, 64, 32), (37, 576, 64), (64, 1536, 128), (32, 96, -1)])
@pytest.mark.parametrize("rows", [1, 3, 8, 512])
def test_int4_kernels_match_the_dequantized_weight(ops, dtype, n, k, group, rows):
    from llmopt.runtime.executor.linear.sparse24_int4_cpu import Sparse24Int4Linear

    qweight = quantized_2of4(n, k, group, seed=n + k, sym=group != 64)
    layer = Sparse24Int4Linear(qweight, dtype)
    weight = qweight.dequantize(torch.float64)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = x.double() @ weight.T
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = expected.abs().max().item()
    operands = (layer.codes, layer.positions, layer.scale, layer.offset)
    with_mask = (*operands, layer.bitmask, layer.group)
    for name, out in (("rows", ops.sparse24_int4_matmul_rows(x, *operands, layer.group)),
                      ("tiled", ops.sparse24_int4_matmul_tiled(x, *with_mask, 64 << 10))):
        assert out.dtype == dtype and out.shape == (rows, n), name
        assert (out.double() - expected).abs().max().item() <= tol * scale, name
    for out_dtype in (torch.float32, torch.bfloat16):  # (fp32 expands from the bitmask, others scatter)
        dense = torch.empty(n, k, dtype=out_dtype)
        ops.sparse24_int4_decompress_out(*with_mask, dense)
        torch.testing.assert_close(dense.double(), weight.to(out_dtype).double(), rtol=tol, atol=tol)
    torch.testing.assert_close(layer.dense_weight().double(), weight, rtol=tol, atol=tol * weight.abs().max().item())


def test_int4_method_is_chosen_for_compressed_codes_and_stacks():
    from llmopt.runtime.executor.linear.int4_cpu import Int4PackedLinear
    from llmopt.runtime.executor.linear.sparse24_int4_cpu import Sparse24Int4Linear

    parts = [make_linear(quantized_2of4(n, 128, 64, seed=n), torch.float32) for n in (64, 32)]
    assert all(isinstance(p, Sparse24Int4Linear) for p in parts)
    fused = fuse_linears(parts, prepack=True)
    x = torch.randn(5, 128)
    for path in fused.row_paths():
        torch.testing.assert_close(fused.run_path(path, x), torch.cat([p(x) for p in parts], dim=-1),
                                   rtol=1e-5, atol=1e-5)
    dense_codes = quantized_2of4(64, 128, 64)
    dense_codes.keep = None  # the same codes not marked compressed: the dense int4 method
    assert isinstance(make_linear(dense_codes, torch.float32), Int4PackedLinear)


def unstructured(n: int, k: int, sparsity: float, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    return (weight * (torch.rand(n, k, generator=g) >= sparsity)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (fp16 differs only in load/store conversions)
@pytest.mark.parametrize("n,k,sparsity", [(48, 64, 0.5), (37, 576, 0.7), (96, 1536, 0.5), (16, 32, 0.0)])
@pytest.mark.parametrize("rows", [1, 3, 8, 512])
def test_unstructured_kernels_match_the_dense_weight(ops, dtype, n, k, sparsity, rows):
    from llmopt.runtime.executor.linear.sparse_bitmask_cpu import SparseBitmaskLinear

    weight = unstructured(n, k, sparsity, seed=n + k, dtype=dtype)
    weight[0] = 0  # an empty row
    layer = SparseBitmaskLinear(BitmaskWeight.from_dense(weight), dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = x.double() @ weight.double().T
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = max(expected.abs().max().item(), 1e-6)
    operands = (layer.values, layer.bitmask, layer.row_offsets)
    for name, out in (("rows", ops.bitmask_matmul_rows(x, *operands)),
                      ("tiled", ops.bitmask_matmul_tiled(x, *operands, 64 << 10))):
        assert out.dtype == dtype and out.shape == (rows, n), name
        assert (out.double() - expected).abs().max().item() <= tol * scale, name
    dense = torch.empty(n, k, dtype=dtype)
    ops.bitmask_decompress_out(*operands, dense)
    assert torch.equal(dense, weight) and torch.equal(layer.dense_weight(), weight)


def test_unstructured_method_paths_and_stacking():
    from llmopt.runtime.executor.linear.sparse_bitmask_cpu import SparseBitmaskLinear

    parts = [make_linear(BitmaskWeight.from_dense(unstructured(n, 64, 0.6, seed=n)), torch.float32)
             for n in (64, 32, 48)]
    assert all(isinstance(p, SparseBitmaskLinear) for p in parts)
    fused = fuse_linears(parts, prepack=True)
    assert isinstance(fused, SparseBitmaskLinear)
    x = torch.randn(9, 64)
    expected = torch.cat([F.linear(x, p.dense_weight()) for p in parts], dim=-1)
    for path in fused.row_paths():
        torch.testing.assert_close(fused.run_path(path, x), expected, rtol=1e-5, atol=1e-5)
