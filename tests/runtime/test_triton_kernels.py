"""Every Triton kernel against its torch reference at small and odd shapes.

On a machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before
they are imported); scripts/gpu_check.sh runs this same file on CUDA.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402,F401  (a dev dependency: these tests must run in CI)

from llmopt.core.contract import QuantScheme  # noqa: E402
from llmopt.core.contract.rounding import quantize_rtn  # noqa: E402
from llmopt.runtime.executor.attention import AttentionMetadata  # noqa: E402
from llmopt.runtime.executor.kernels.quant_matmul import reference_quant_matmul  # noqa: E402
from llmopt.runtime.executor.kernels.triton_decode_attention import decode_attention  # noqa: E402
from llmopt.runtime.executor.kernels.triton_prefill_attention import prefill_attention  # noqa: E402
from llmopt.runtime.executor.kernels.triton_store_kv import store_kv as triton_store_kv  # noqa: E402
from llmopt.runtime.executor.kernels.triton_w4a16 import pack_w4a16, w4a16_matmul  # noqa: E402
from tests.runtime.attention_calls import attend, metadata, store  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def paged_setup(context_lens, num_heads, num_kv_heads, head_dim, page, dtype, seed=0, device=DEVICE):
    """Random caches and shuffled block tables holding len(context_lens) sequences."""
    g = torch.Generator().manual_seed(seed)
    pages = [(c + page - 1) // page for c in context_lens]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in pages:
        tables.append(order[used:used + n])
        used += n
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("context_lens,num_heads,num_kv_heads,head_dim,page,num_splits", [
    ([5], 4, 2, 16, 4, None), ([1, 17, 33], 6, 2, 24, 8, 3), ([40, 3], 3, 3, 32, 16, 2), ([70], 8, 1, 64, 16, 4),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_attention(context_lens, num_heads, num_kv_heads, head_dim, page, num_splits, dtype):
    k_cache, v_cache, tables = paged_setup(context_lens, num_heads, num_kv_heads, head_dim, page, dtype)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = q.to(DEVICE)
    meta = AttentionMetadata.build(list(range(len(context_lens) + 1)), context_lens, tables,
                                   torch.zeros(len(context_lens), dtype=torch.long), page, DEVICE)
    expected = attend("torch", q.float(), k_cache.float(), v_cache.float(), meta, head_dim ** -0.5)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, block_tables, torch.tensor(context_lens, device=DEVICE),
                           head_dim ** -0.5, num_splits)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("new_and_ctx,num_heads,num_kv_heads,head_dim", [
    ([(5, 5)], 2, 1, 16),  # plain prefill
    ([(3, 20), (17, 17), (1, 9)], 4, 2, 32),  # chunks over cached prefixes, and a one-token chunk
    ([(40, 50)], 3, 3, 24),  # several query blocks, odd head_dim
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page", [16, 4])  # pages of 4 tokens: read four to a tile (tl.dot needs 16 on a GPU)
def test_prefill_attention(new_and_ctx, num_heads, num_kv_heads, head_dim, dtype, page):
    context_lens = [c for _, c in new_and_ctx]
    k_cache, v_cache, tables = paged_setup(context_lens, num_heads, num_kv_heads, head_dim, page, dtype)
    starts = [0]
    for new, _ in new_and_ctx:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    meta = AttentionMetadata.build(starts, context_lens, tables, torch.zeros(starts[-1], dtype=torch.long), page,
                                   DEVICE)
    expected = attend("torch", q.float(), k_cache.float(), v_cache.float(), meta, head_dim ** -0.5)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    out = prefill_attention(q, k_cache, v_cache, torch.tensor(starts, device=DEVICE),
                            torch.tensor(context_lens, device=DEVICE), block_tables, head_dim ** -0.5,
                            max(n for n, _ in new_and_ctx), block_m=16)
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("new_and_ctx", [[(1, 9), (1, 17), (1, 4)], [(3, 20), (9, 9), (1, 9)]],
                         ids=["decodes", "mixed"])
def test_the_triton_backend_builds_its_metadata_and_attends_as_the_torch_one(new_and_ctx):
    """The Triton backend's own metadata (the step as device tensors) drives its decode kernel on a decode-only step
    and its prefill kernel otherwise, to the torch backend's outputs."""
    from llmopt.runtime.executor.attention.triton import TritonMetadata

    context_lens = [c for _, c in new_and_ctx]
    num_heads, num_kv_heads, head_dim, page = 4, 2, 32, 16
    k_cache, v_cache, tables = paged_setup(context_lens, num_heads, num_kv_heads, head_dim, page, torch.float32)
    starts = [0]
    for new, _ in new_and_ctx:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    slots = torch.zeros(starts[-1], dtype=torch.long, device=DEVICE)
    meta = metadata("triton", starts, context_lens, tables, slots, page, DEVICE)
    assert isinstance(meta, TritonMetadata) and meta.max_new_tokens == max(n for n, _ in new_and_ctx)
    assert meta.block_tables_tensor.shape == (len(tables), max(len(t) for t in tables))
    got = attend("triton", q, k_cache, v_cache, meta, head_dim ** -0.5)
    want = attend("torch", q, k_cache, v_cache, metadata("torch", starts, context_lens, tables, slots, page, DEVICE),
                  head_dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv(dtype):
    g = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(6, 4, 3, 10, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(7, 3, 10, generator=g).to(DEVICE)
    v = torch.randn(7, 3, 10, generator=g).to(DEVICE)
    slots = torch.tensor([0, 5, 6, 23, 12, 13, 2], device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store("torch", k, v, ref_k, ref_v, slots)
    triton_store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# group 48 steps by 16 columns inside a group; group 8 by 32 columns over four groups (a scale row per column)
@pytest.mark.parametrize("m,n,k,group_size,sym", [(1, 64, 64, 32, True), (5, 80, 128, 64, False),
                                                  (33, 48, 96, 32, False), (17, 128, 256, 128, True),
                                                  (3, 40, 96, 48, False), (18, 32, 64, 8, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w4a16_matmul(m, n, k, group_size, sym, dtype):
    g = torch.Generator().manual_seed(4)
    qw = quantize_rtn(torch.randn(n, k, generator=g), QuantScheme(4, group_size, sym))
    x = torch.randn(m, k, generator=g).to(dtype)
    expected = reference_quant_matmul(x.float(), qw.q, qw.scales, qw.zeros, qw.g_idx)
    qweight, scales, zeros = pack_w4a16(qw.q.to(DEVICE), qw.scales.to(DEVICE), qw.zeros.to(DEVICE), dtype)
    y = w4a16_matmul(x.to(DEVICE), qweight, scales, zeros, group_size)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float().cpu(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_w4a16_matmul_keeps_float_zero_points_in_float32(dtype):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=g) * 0.002 + 0.1  # groups far from 0: zero points near -100
    qw = quantize_rtn(w, QuantScheme(4, 32, False, zero_point="float"))
    x = torch.randn(3, 128, generator=g).to(dtype)
    expected = reference_quant_matmul(x.float(), qw.q, qw.scales, qw.zeros, qw.g_idx)
    qweight, scales, zeros = pack_w4a16(qw.q.to(DEVICE), qw.scales.to(DEVICE), qw.zeros.to(DEVICE), dtype)
    assert zeros.dtype == torch.float32
    y = w4a16_matmul(x.to(DEVICE), qweight, scales, zeros, 32)
    # the weights are rounded to `dtype` for tl.dot, the zero points not
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float().cpu(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("group_size,itemsize,expected", [
    (128, 2, (128, True)), (128, 4, (64, True)), (32, 4, (32, True)), (48, 2, (16, True)), (576, 2, (64, True)),
    (8, 2, (32, False)), (40, 4, (32, False)),
])
def test_a_k_step_stays_inside_one_scale_group_and_within_shared_memory(group_size, itemsize, expected):
    from llmopt.runtime.executor.kernels.triton_w4a16 import step_columns

    assert step_columns(group_size, itemsize) == expected


def test_a_method_built_for_a_device_keeps_its_bias_there():
    """The bias goes where the method's weights go (a CUDA method's bias on the CPU failed at the first add)."""
    from llmopt.core.contract import preset
    from llmopt.runtime.executor.linear.base import stacked_bias
    from llmopt.runtime.executor.linear.triton_lowprec import TritonW8A8Linear

    g = torch.Generator().manual_seed(0)
    linear = preset("w8a8-int8")
    with_bias = quantize_rtn(torch.randn(16, 32, generator=g), linear.weights, bias=torch.randn(16, generator=g))
    without = quantize_rtn(torch.randn(8, 32, generator=g), linear.weights)
    parts = [TritonW8A8Linear(q, torch.float16, "meta") for q in (with_bias, without)]
    assert parts[0].weight.device.type == parts[0].bias.device.type == "meta"
    stacked = stacked_bias(parts, torch.float16)
    assert stacked.device.type == "meta" and stacked.shape == (24,)


def _linear(method_cls, qweight, dtype):
    """A CUDA linear method built on this test's device (its kernels run in the interpreter without a GPU)."""
    return method_cls(qweight, dtype, DEVICE)


@pytest.mark.parametrize("rows", [1, 3, 8, 512])
@pytest.mark.parametrize("scheme", ["w8a8-int8", "w8a8-fp8"])
def test_w8a8_triton_matches_the_reference(rows, scheme):
    # int8: the int32 sums are exact, so only the epilogue's fp32 rounding differs from the reference
    from llmopt.core.contract import preset
    from llmopt.core.contract.activations import InputQuantizedLinear
    from llmopt.runtime.executor.linear.triton_lowprec import TritonW8A8Linear

    g = torch.Generator().manual_seed(rows)
    linear = preset(scheme)
    qweight = quantize_rtn(torch.randn(80, 96, generator=g), linear.weights, bias=torch.randn(80, generator=g))
    qweight.input_activations = linear.input_activations
    x = torch.randn(rows, 96, generator=g) * 3
    with torch.no_grad():
        expected = InputQuantizedLinear.of(qweight, torch.float32)(x)
        y = _linear(TritonW8A8Linear, qweight, torch.float32)(x.to(DEVICE)).cpu()
    if scheme == "w8a8-fp8" and DEVICE == "cuda":
        # Hopper's FP8 tensor cores (wgmma, at 64-row tiles) sum with about 14 bits of mantissa, not fp32's 24:
        # Triton's default on sm_90, like cuBLAS's fast accumulation (measured: within 2^-11 of the largest output)
        torch.testing.assert_close(y, expected, rtol=0, atol=2**-9 * expected.abs().max().item())
    else:
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 8, 512])
@pytest.mark.parametrize("scheme", ["w8a16-fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float_weight_triton_matches_the_dequantized_weight(rows, scheme, dtype):
    from llmopt.core.contract import preset
    from llmopt.runtime.executor.linear.triton_lowprec import TritonFloatWeightLinear

    g = torch.Generator().manual_seed(rows + 7)
    qweight = quantize_rtn(torch.randn(72, 128, generator=g) * 0.1, preset(scheme).weights)
    x = torch.randn(rows, 128, generator=g).to(dtype)
    expected = x.float() @ qweight.dequantize().t()
    y = _linear(TritonFloatWeightLinear, qweight, dtype)(x.to(DEVICE)).float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("rows", [1, 3, 8, 512])
@pytest.mark.parametrize("n,k", [(48, 64), (37, 160), (64, 576)])  # odd N and K not a multiple of the K step
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse24_triton_matches_the_dense_weight(rows, n, k, dtype):
    from llmopt.core.contract.sparse24 import Sparse24Weight
    from llmopt.runtime.executor.linear.triton_sparse24 import TritonSparse24Linear
    from tests.runtime.test_sparse24_kernels import sparse_2of4

    weight = Sparse24Weight.from_dense(sparse_2of4(n, k, seed=n + k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = x.double() @ weight.decompress().double().t()
    layer = _linear(TritonSparse24Linear, weight, dtype)
    assert layer.semi_structured is None or CUDA
    y = layer(x.to(DEVICE)).double().cpu()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("rows", [1, 3, 8, 512])
@pytest.mark.parametrize("n,k,group", [(48, 64, 32), (37, 576, 64), (64, 256, 128), (32, 96, -1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse24_int4_triton_matches_the_dequantized_weight(rows, n, k, group, dtype):
    from llmopt.runtime.executor.linear.triton_sparse24 import TritonSparse24Int4Linear
    from tests.runtime.test_sparse24_kernels import quantized_2of4

    qweight = quantized_2of4(n, k, group, seed=n + k, sym=group != 64)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = x.double() @ qweight.dequantize(torch.float64).t()
    layer = _linear(TritonSparse24Int4Linear, qweight, dtype)
    assert layer.codes.numel() * 8 == qweight.q.numel() // 2  # the kept codes only: 8 per int32 word
    y = layer(x.to(DEVICE)).double().cpu()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_cuda_methods_are_chosen_for_compressed_2of4_weights(monkeypatch):
    """On a CUDA device the compressed weights go to the 2:4 Triton methods, not the dense or dense-int4 ones."""
    from llmopt.core.contract import LinearScheme
    from llmopt.core.contract.sparse24 import Sparse24Weight
    from llmopt.runtime.executor.kernels import triton_support
    from llmopt.runtime.executor.linear import select_linear_method
    from tests.runtime.test_sparse24_kernels import quantized_2of4, sparse_2of4

    monkeypatch.setattr(triton_support, "triton_available", lambda: True)
    cuda = torch.device("cuda")
    qweight = quantized_2of4(64, 128, 64)
    assert select_linear_method(qweight, LinearScheme(qweight.scheme), cuda).name == "sparse24-int4-triton"
    qweight.keep = None
    assert select_linear_method(qweight, LinearScheme(qweight.scheme), cuda).name == "w4a16-triton"
    weight = Sparse24Weight.from_dense(sparse_2of4(64, 128))
    assert select_linear_method(weight, LinearScheme(None), cuda).name == "sparse24-cuda"
    assert select_linear_method(weight, LinearScheme(None), torch.device("cpu")).name == "sparse24-cpu"
