"""The compiled CPU kernels (llmopt/runtime/executor/kernels/csrc) against the torch backend, in every build this CPU
can run (scalar, avx2, avx512, avx512_bf16: the `ops` fixture), at small and odd shapes that reach every code
path: the vector paths specialized on (group, head_dim) (AVX512_BF16 dot products 16 rows at a time when the
block size allows, one row at a time otherwise), the scalar path for other shapes, whole sequences per work item
and one KV head per item. Also the prefill attention's batched path over this step's keys."""

import pytest
import torch

from llmopt.core.hardware import supported_kernel_isas
from llmopt.runtime.executor.attention import AttentionMetadata, cpu, metadata
from llmopt.runtime.executor.attention.torch_sdpa import fresh_runs
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from tests.runtime.attention_calls import attend
from tests.runtime.test_triton_kernels import paged_setup as triton_paged_setup


def paged_setup(context_lens, num_heads, num_kv_heads, head_dim, page, dtype, seed=0):
    """The Triton tests' random caches and shuffled block tables, on CPU, with queries and the metadata."""
    k_cache, v_cache, tables = triton_paged_setup(context_lens, num_heads, num_kv_heads, head_dim, page, dtype, seed,
                                                  device="cpu")
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata.build(list(range(len(context_lens) + 1)), context_lens, tables,
                                   torch.zeros(len(context_lens), dtype=torch.long), page)
    return q, k_cache, v_cache, meta


@pytest.fixture(params=supported_kernel_isas())
def ops(request):
    """Each build of the kernels this CPU can execute."""
    built = cpu_ops(request.param)
    assert built is not None, f"the {request.param} kernels failed to build"
    return built


def test_cpu_kernels_build(ops):
    # CI machines have a compiler: a build failure must fail here, not silently fall back to torch
    assert ops.vectorized() == (ops.isa() != "scalar")


@pytest.mark.parametrize("context_lens,num_heads,num_kv_heads,head_dim,page", [
    ([5], 4, 2, 16, 4),  # scalar path (head_dim 16), one sequence: one KV head per item
    ([1, 17, 33], 6, 2, 24, 8),  # scalar path, odd head_dim
    ([40, 3, 16, 31, 64], 9, 3, 64, 16),  # SmolLM2's heads; partial groups of 16 rows; whole sequences per item
    ([70], 8, 1, 64, 16),  # group 8, a single KV head
    ([100, 7], 4, 4, 128, 16),  # no GQA, head_dim 128
    ([45, 12, 77], 8, 4, 128, 16),  # group 2, head_dim 128: on AVX2 pass 2 runs over the values in 4 column runs
    ([33, 50, 8, 9], 16, 2, 32, 8),  # block size 8: one row at a time
    ([70, 33, 100, 16], 9, 3, 64, 32),  # block size 32: two groups of 16 rows a block, rows two blocks on requested
    ([20] * 6, 18, 2, 64, 16),  # group 9: beyond the specialized ones
    ([3000], 9, 3, 64, 16),  # one long context: split across threads (bf16 from pairs), the splits merged
    ([2100, 40], 6, 2, 24, 8),  # split, scalar path; the short sequence's second split is empty
    ([2500, 1100], 8, 4, 128, 8),  # split, block size 8 (one row at a time)
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_decode_attention_matches_reference(ops, context_lens, num_heads, num_kv_heads, head_dim, page, dtype):
    q, k_cache, v_cache, meta = paged_setup(context_lens, num_heads, num_kv_heads, head_dim, page, dtype)
    scale = head_dim ** -0.5
    expected = attend("torch", q.float(), k_cache.float(), v_cache.float(), meta, scale)
    out = ops.paged_decode_attention(q, k_cache, v_cache, meta.decode.block_tables, meta.decode.context_lens,
                                           scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def test_paged_decode_attention_of_no_sequences_is_empty(ops):
    q, k_cache, v_cache, meta = paged_setup([3000], 9, 3, 64, 16, torch.bfloat16)
    out = ops.paged_decode_attention(q[:0], k_cache, v_cache, meta.decode.block_tables[:0],
                                     meta.decode.context_lens[:0], 0.125)
    assert out.shape == (0, 9, 64)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_paged_decode_attention_takes_fp32_queries_over_a_16_bit_cache(ops, cache_dtype):
    # an fp32 model's fp16 / bf16 cache: q and the output stay fp32 (q is not rounded to the cache's dtype)
    q, k_cache, v_cache, meta = paged_setup([40, 3, 16, 31, 64], 9, 3, 64, 16, cache_dtype)
    q = q.float() + 1e-3 * torch.randn(q.shape)  # values a 16-bit q would round
    expected = attend("torch", q, k_cache.float(), v_cache.float(), meta, 0.125)
    out = ops.paged_decode_attention(q, k_cache, v_cache, meta.decode.block_tables, meta.decode.context_lens, 0.125)
    assert out.dtype == torch.float32
    tol = 1e-5 if cache_dtype == torch.float16 else 2e-2  # (the AVX512_BF16 build's key pass rounds q to bf16)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.paged_decode_attention(q.to(torch.float16), k_cache.float(), v_cache.float(),
                                   meta.decode.block_tables, meta.decode.context_lens, 0.125)


@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_paged_decode_attention_takes_16_bit_queries_over_the_other_16_bit_cache(ops, q_dtype, cache_dtype):
    # a bf16 model over an fp16 cache (llama.cpp's default type): the queries read in fp32, the output in q's dtype
    q, k_cache, v_cache, meta = paged_setup([40, 3, 16, 31, 64], 9, 3, 64, 16, cache_dtype)
    q = q.to(q_dtype)
    expected = attend("torch", q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    out = ops.paged_decode_attention(q, k_cache, v_cache, meta.decode.block_tables, meta.decode.context_lens, 0.125)
    assert out.dtype == q_dtype
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    fp32_queries = ops.paged_decode_attention(q.float(), k_cache, v_cache, meta.decode.block_tables,
                                              meta.decode.context_lens, 0.125)
    assert torch.equal(out, fp32_queries.to(q_dtype))


def test_paged_decode_attention_reads_q_as_a_view_of_wider_rows(ops):
    # the decoder passes q as a view into the fused q/k/v output: rows strided, heads contiguous
    q, k_cache, v_cache, meta = paged_setup([12, 40, 3, 17], 6, 2, 64, 16, torch.bfloat16)
    rows = torch.randn(q.shape[0], 10, 64).to(torch.bfloat16)
    rows[:, 2:8] = q
    view = rows[:, 2:8]
    assert not view.is_contiguous()
    args = (k_cache, v_cache, meta.decode.block_tables, meta.decode.context_lens, 0.125)
    assert torch.equal(ops.paged_decode_attention(view, *args), ops.paged_decode_attention(q, *args))


def test_bf16_decodes_use_the_kernel(monkeypatch):
    ops = cpu_ops()
    calls = []

    class Spy:
        def paged_decode_attention(self, *args):
            calls.append(args)
            return ops.paged_decode_attention(*args)

    monkeypatch.setattr(cpu, "cpu_ops", lambda: Spy())
    q, k_cache, v_cache, meta = paged_setup([12, 40, 3], 6, 2, 64, 16, torch.bfloat16)
    out = attend("cpu", q, k_cache, v_cache, meta, 0.125)
    assert len(calls) == 1
    expected = attend("torch", q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    assert len(calls) == 1  # fp32 keeps the torch path (it must match transformers token for token)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_context_beyond_block_table_is_an_error(ops):
    q, k_cache, v_cache, meta = paged_setup([20], 4, 2, 64, 16, torch.bfloat16)
    with pytest.raises(RuntimeError, match="context length"):
        ops.paged_decode_attention(q, k_cache, v_cache, meta.decode.block_tables, torch.tensor([33]), 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 40), (70, 99)])  # scalar tails; one thread and several
def test_fused_elementwise_ops_match_torch(ops, dtype, rows, hidden):
    import torch.nn.functional as F

    from llmopt.runtime.executor.models.layers import rotate_half

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = torch.randn(hidden, generator=g).to(dtype)

    def norm(t):
        return F.rms_norm(t.float(), (hidden,), eps=1e-5).to(dtype) * weight

    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    # the norms round as torch's vectorized kernels do; torch built for no vector unit sums the squares in another
    # order, and one 16-bit output in ~7,000 lands an ulp away
    norm_tol = tol if torch.backends.cpu.get_cpu_capability() != "DEFAULT" or dtype == torch.float32 else {
        "rtol": torch.finfo(dtype).eps, "atol": 0}
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), norm(x), **norm_tol)
    residual = x.clone()
    normed = ops.add_rms_norm_(residual, delta, weight, 1e-5)
    assert torch.equal(residual, x + delta)
    torch.testing.assert_close(normed, norm(x + delta), **norm_tol)

    gate_up = (torch.randn(rows, 2 * hidden, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6 if dtype == torch.float32 else 0,
                               atol=1e-6 if dtype == torch.float32 else 0)

    head_dim, heads = 2 * (hidden // 2), 3
    qkv = torch.randn(rows, (heads + 1) * head_dim, generator=g).to(dtype)
    angles = torch.randn(rows, head_dim // 2, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    expected = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    rotated = qkv.clone()
    ops.rotary_(rotated, cos, sin, heads)
    torch.testing.assert_close(rotated[:, : heads * head_dim].view(rows, heads, head_dim), expected, **tol)
    assert torch.equal(rotated[:, heads * head_dim:], qkv[:, heads * head_dim:])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_follows_torch_argmax(ops, dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g).to(dtype)
    logits[1, 10] = logits[1, 990] = 50.0  # ties: the first index
    logits[2, 999] = 60.0  # in the scalar tail
    logits[3, 7] = logits[3, 500] = float("nan")  # NaN counts as the maximum
    logits[4] = float("-inf")
    logits[5, 3] = logits[5, 4] = 1e-3  # bf16 ties that fp32 values would not make
    logits[5, 3] += 1e-6
    assert torch.equal(ops.argmax_rows(logits), logits.float().argmax(dim=-1))


def test_decoder_with_fused_ops_matches_the_torch_ops():
    from llmopt.core.tiny import build_tiny_model
    from llmopt.runtime.engine.engine import Engine, EngineConfig
    from llmopt.runtime.engine.sampling import SamplingParams

    model, tok = build_tiny_model("llama", seed=0)
    model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outputs = []
    for fused in (True, False):
        engine = Engine(model, tok, EngineConfig(block_size=4, fast_path=True))
        decoder = engine.runner.decoder
        assert decoder.fused_ops is not None
        if not fused:
            decoder.fused_ops = None
        # the batch, then one prompt alone (batch-1 steps: the lm_head runs as the gemv kernel with the fused ops)
        outputs.append([o.token_ids for o in engine.generate(prompts, params) + engine.generate(prompts[1:2], params)])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_store_kv_writes_strided_rows_into_their_slots(ops, dtype, cache_dtype):
    # (fp32 keys and values into a 16-bit cache, or one 16-bit type into the other: each value rounded as .to()
    # rounds it)
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 2, 8, 5
    qkv = torch.randn(tokens, (3 + 2 * kv_heads) * head_dim, generator=g).to(dtype)  # k, v: views into it
    k = qkv[:, 3 * head_dim:(3 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (3 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([3, 17, 0, 23, 9])
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(cache_dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    expected[0].view(-1, kv_heads, head_dim)[slots] = k.to(cache_dtype)
    expected[1].view(-1, kv_heads, head_dim)[slots] = v.to(cache_dtype)
    ops.store_kv_(caches[0], caches[1], k, v, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    with pytest.raises(RuntimeError, match="slot outside"):
        ops.store_kv_(caches[0], caches[1], k, v, torch.tensor([0, 1, 2, 3, 24]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [100, 576])  # K = 100: a scalar tail
@pytest.mark.parametrize("rows", [1, 3, 6, 8, 19])  # 1: decode; 3-8: speculative verification; 19: 8 + 8 + 3
def test_gemv_matches_a_float_matmul(ops, dtype, k, rows):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1001, k, generator=g).to(dtype)  # odd rows: 4-row groups and a remainder
    x = torch.randn(rows, k, generator=g).to(dtype)
    expected = (x.float() @ weight.float().t()).to(dtype)
    # sums of 576 products of magnitude ~24: the scalar build's sequential order differs from BLAS's by ~3e-5
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ops.gemv(x, weight), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seqs,new,ctx,heads,kv_heads,head_dim", [
    (1, 1, 1, 2, 1, 16), (3, 37, 37, 9, 3, 64), (2, 20, 150, 4, 2, 128), (1, 70, 70, 6, 6, 32),
    (2, 33, 100, 8, 1, 48), (1, 300, 300, 3, 1, 32), (2, 40, 600, 4, 2, 64)])
def test_causal_prefill_attention_matches_masked_sdpa(ops, dtype, seqs, new, ctx, heads, kv_heads, head_dim):
    # each sequence's new queries (its last `new` positions) over its ctx keys: GQA groups 1-8, row tiles with a
    # remainder, keys past one key panel and past one 256-key chunk (the running softmax), a head_dim past whole
    # 64-column tiles; q a view of wider rows (as the qkv projection's output is)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(seqs * new, heads + 7, head_dim, generator=g).to(dtype)[:, 3:3 + heads]
    k, v = (torch.randn(seqs * ctx, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    if not ops.vectorized():
        with pytest.raises(RuntimeError, match="vector build"):
            ops.causal_prefill_attention(q, k, v, new, head_dim ** -0.5)
        return
    out = ops.causal_prefill_attention(q, k, v, new, head_dim ** -0.5)
    qb, kb, vb = (x.reshape(seqs, -1, x.shape[1], head_dim).transpose(1, 2).float() for x in (q, k, v))
    mask = torch.ones(new, ctx, dtype=torch.bool).tril(ctx - new)
    expected = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=head_dim ** -0.5,
                                                                enable_gqa=True)
    expected = expected.transpose(1, 2).reshape(seqs * new, heads, head_dim)
    assert out.dtype == dtype and out.shape == expected.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_causal_prefill_attention_refuses_what_it_cannot_attend(ops):
    if not ops.vectorized():
        pytest.skip("the scalar build refuses every call")
    q, k = torch.randn(8, 4, 64), torch.randn(8, 2, 64)
    with pytest.raises(RuntimeError, match="ctx >= new"):
        ops.causal_prefill_attention(q, k[:4], k[:4], 8, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.causal_prefill_attention(q[..., :40], k[..., :40], k[..., :40], 8, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.causal_prefill_attention(q, k.bfloat16(), k.bfloat16(), 8, 0.125)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_over_this_steps_keys_matches_the_cache_path(monkeypatch, dtype, backend):
    # fresh prompts (nothing cached before: equal-length neighbours batched into one causal SDPA, or in the cpu
    # backend the compiled prefill kernel) next to a decode and a prompt with a cached prefix (those keep the
    # per-sequence path, or the same kernel over the gathered blocks): same output either way
    new_lens = [5, 5, 5, 7, 1, 9, 5]
    context_lens = [5, 5, 5, 7, 10, 12, 5]
    page, num_heads, num_kv_heads, head_dim = 4, 6, 2, 16
    k_cache, v_cache, tables = triton_paged_setup(context_lens, num_heads, num_kv_heads, head_dim, page, dtype, 3,
                                                  device="cpu")
    starts = [0]
    slots = []
    for table, ctx, new in zip(tables, context_lens, new_lens):
        starts.append(starts[-1] + new)
        slots += [table[p // page] * page + p % page for p in range(ctx - new, ctx)]
    slots = torch.tensor(slots)
    meta = AttentionMetadata.build(starts, context_lens, tables, slots, page)
    assert fresh_runs(meta.prefills)[0] == [(0, 3, 5), (15, 1, 7), (32, 1, 5)]
    q = torch.randn(starts[-1], num_heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    k_new = k_cache.view(-1, num_kv_heads, head_dim)[slots]
    v_new = v_cache.view(-1, num_kv_heads, head_dim)[slots]
    expected = attend("torch", q, k_cache, v_cache, meta, head_dim ** -0.5)
    calls = []
    real = cpu.compiled_prefill_kernel

    def counted(q):
        kernel = real(q)
        return None if kernel is None else (lambda *args: calls.append(args[3]) or kernel(*args))

    monkeypatch.setattr(cpu, "compiled_prefill_kernel", counted)
    out = attend(backend, q, k_cache, v_cache, meta, head_dim ** -0.5, k_new, v_new)
    if backend == "cpu" and real(q) is not None:  # the three fresh runs, then the 9 tokens after a cached prefix
        assert calls == [5, 7, 5, 9]
    else:
        assert calls == []
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,rows", [(48, 192, 32, 1), (37, 192, 64, 3), (16, 96, 48, 5), (64, 256, 128, 2)])
def test_int4_matmul_rows_matches_the_dequantized_weight(ops, dtype, n, k, group, rows):
    # straight from the 4-bit codes: 1-5 rows (pairs and a single), 4/2/1 outputs at a time, a group of 48 whose
    # 24 bytes leave a scalar tail after each 16-byte chunk
    from llmopt.runtime.executor.kernels.quant_matmul import int4_dequantize, pack_nibbles

    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), generator=g)
    so = torch.stack([torch.rand(k // group, n, generator=g) * 0.1, torch.randn(k // group, n, generator=g) * 0.1],
                     dim=-1).to(dtype)
    nibbles = pack_nibbles(q)
    x = torch.randn(rows, k, generator=g).to(dtype)
    expected = x.float() @ int4_dequantize(nibbles, so.float(), group).t()
    out = ops.int4_matmul_rows(x, nibbles, so, group)
    assert out.dtype == dtype and out.shape == (rows, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16])
def test_gemv_reads_a_narrower_weight_with_fp32_inputs(ops, narrow):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(203, 576, generator=g).to(narrow)
    x = torch.randn(1, 576, generator=g)
    out = ops.gemv(x, weight)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x @ weight.float().t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("narrow", [None, torch.float16])
def test_gemv_gives_an_input_the_same_bits_at_every_row_count(ops, dtype, narrow):
    """A row's logits do not depend on how many rows share the step: each path (1 row; 2-6 rows; 7-8 rows a half
    of each vector at a time on AVX2; more rows 8 at a time over blocks of weight rows) sums the same products in
    the same order: bf16 pairs through vdpbf16ps where the build has AVX512_BF16, at every row count; the weight
    rows a thread's range ends with (past a whole group of 4) through the same vector chain as the others."""
    if narrow is not None and dtype != torch.float32:
        pytest.skip("narrower weights go with fp32 inputs")
    for seed in range(5):  # (one draw's outputs can agree by the output dtype's rounding alone)
        g = torch.Generator().manual_seed(seed)
        weight = torch.randn(4098, 576, generator=g).to(narrow or dtype)  # each thread's range ends in a remainder
        x = torch.randn(21, 576, generator=g).to(dtype)
        alone = torch.cat([ops.gemv(x[m:m + 1], weight) for m in range(21)])
        for rows in range(2, 22):
            assert torch.equal(ops.gemv(x[:rows], weight), alone[:rows]), (seed, rows)


@pytest.mark.parametrize("vendor,isa,streams", [
    ("GenuineIntel", "avx512_bf16", 4), ("GenuineIntel", "avx512", 4), ("GenuineIntel", "avx2", 1),
    ("AuthenticAMD", "avx512_bf16", 1), ("AuthenticAMD", "avx2", 1), ("GenuineIntel", "scalar", 1),
])
def test_gemv_streams_one_row_at_a_time_on_amd_and_four_on_intel_avx512(monkeypatch, vendor, isa, streams):
    # the build flag each CPU's kernels get (measured: one sequential stream is faster on Zen 3 and Zen 4)
    import dataclasses

    from llmopt.runtime.executor.kernels import cpu_ops as cpu_ops_module

    info = dataclasses.replace(cpu_ops_module.cpu_info(), vendor=vendor, arch="x86_64")
    monkeypatch.setattr(cpu_ops_module, "cpu_info", lambda: info)
    assert cpu_ops_module.gemv_row_streams(isa) == streams
    # against two input rows the AVX2 build streams two weight rows on Intel, one on AMD (as for one input)
    assert cpu_ops_module.gemv_pair_streams(isa) == (1 if vendor == "AuthenticAMD" else 2)


def test_exactly_narrowed_keeps_every_value():
    from llmopt.runtime.executor.models.llama import exactly_narrowed

    halves = torch.randn(64, 32).half().float()  # an fp16 checkpoint loaded in fp32
    assert exactly_narrowed(halves).dtype == torch.float16
    assert torch.equal(exactly_narrowed(halves).float(), halves)
    bf16s = (torch.randn(64, 32) * 1e-9).bfloat16().float()  # below fp16's range: bf16 keeps them
    assert exactly_narrowed(bf16s).dtype == torch.bfloat16
    full = torch.randn(64, 32)
    assert exactly_narrowed(full) is full


def q8_rounded_inputs(x, act_group):
    """x [rows, K] rounded to int8 per (row, block of act_group) as the 8-bit inputs' kernels round it (fp32 x *
    (127 / max|x|), half to even), back in float64 (d = max|x| / 127)."""
    rows, k = x.shape
    xf = x.float().view(rows, k // act_group, act_group)
    amax = xf.abs().amax(-1, keepdim=True)
    # 127 / max|x| rounded once to fp32 (torch's fp32 division may differ by an ulp, which flips ties)
    inv = torch.where(amax > 0, (127 / amax.double()).float(), torch.zeros_like(amax))
    return ((xf * inv).round().double() * (amax.double() / 127)).view(rows, k)


def q8_reference(x, q, scales, zeros, group, act_group):
    """int4_matmul_q8's arithmetic in float64: the rounded inputs, the integer products exact, the biases' term on
    the rounded inputs too (the dequantized weight times the rounded inputs); scales and biases as the float16 the
    layout keeps."""
    scale = scales.half().double().repeat_interleave(group, 1)  # [N, K]
    bias = (-zeros.float() * scales.float()).half().double().repeat_interleave(group, 1)
    return q8_rounded_inputs(x, act_group) @ (scale * q.double() + bias).t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,act_group", [(112, 192, 64, 32), (48, 256, 128, 64), (16, 96, 32, 32),
                                                 (80, 384, 32, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 64, 257])
def test_int4_matmul_q8_is_exact_for_its_8_bit_inputs(ops, dtype, n, k, group, act_group, rows):
    # 7 and 5 panels: the blocks of 4 (or 2) panels at one and two rows and the single panels after them
    from llmopt.runtime.executor.kernels.quant_matmul import pack_int4_q8

    g = torch.Generator().manual_seed(n + k + rows)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    x = torch.randn(rows, k, generator=g).to(dtype)
    x[0, :act_group] = 0  # an all-zero block: scale 0, no division by it
    codes, scales_biases = pack_int4_q8(q, scales, zeros, group, group)
    out = ops.int4_matmul_q8(x, codes, scales_biases, group, act_group)
    expected = q8_reference(x, q, scales, zeros, group, act_group)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_int4_matmul_q8_sums_blocks_of_the_largest_products_exactly(ops, rows):
    # codes 15 against inputs rounded to +-127 in every column of a block: the largest sums the kernel's narrow
    # accumulators hold (AVX2 adds a block's u8 x s8 pairs in int16: 4 chunks x 7620 = 30480 per lane)
    from llmopt.runtime.executor.kernels.quant_matmul import pack_int4_q8

    n, k, group = 32, 128, 32
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(rows))
    q[:16] = 15
    q[16:20] = 0
    scales, zeros = torch.full((n, k // group), 2.0 ** -6), torch.zeros(n, k // group)  # (exact in fp16)
    x = torch.ones(rows, k)
    x[1::2] = -1  # -127 inputs
    if rows > 2:
        x[2, ::2] = -1  # signs alternating within a block
    out = ops.int4_matmul_q8(x, *pack_int4_q8(q, scales, zeros, group, group), group, group)
    expected = q8_reference(x, q, scales, zeros, group, group)
    assert out[0, 0].item() == 15 * k * 2.0 ** -6
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matmul_q8_gives_a_row_the_same_bits_at_every_row_count(ops, dtype):
    # rows 1-21: one and two rows (several panels a call), row tiles of 4, 2, 1, and from 16 rows the AVX2 loop over
    # panels split once (int4_q8_cpu.cpp: Q8_UNPACK_ROWS): every path sums a row's products in the same order
    from llmopt.runtime.executor.kernels.quant_matmul import pack_int4_q8

    n, k, group = 112, 384, 32
    g = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (n, k), generator=g)
    codes, scales_biases = pack_int4_q8(q, torch.rand(n, k // group, generator=g) * 0.1 + 0.01,
                                        torch.randint(0, 16, (n, k // group), generator=g).float(), group, group)
    x = (torch.randn(21, k, generator=g) * 3).to(dtype)
    alone = torch.cat([ops.int4_matmul_q8(x[i:i + 1], codes, scales_biases, group, group) for i in range(21)])
    for rows in range(2, 22):
        assert torch.equal(ops.int4_matmul_q8(x[:rows], codes, scales_biases, group, group), alone[:rows]), rows


@pytest.fixture
def thread_counts():
    """Runs a body at 1, 2 and 3 threads, torch's count restored after."""
    before = torch.get_num_threads()

    def each(body):
        outputs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outputs.append(body())
        return outputs

    yield each
    torch.set_num_threads(before)


def test_the_chunked_kernels_give_the_same_bits_at_any_thread_count(ops, thread_counts):
    # the hot kernels hand their work out in chunks to whichever thread is free (csrc/work_queue.h): at 2 and 3
    # threads every output is computed exactly once, as at 1, whatever thread takes its chunk. Shapes whose last
    # chunk is partial: 37 panels (int4 and int8 with 8-bit inputs), 4,100 weight rows (gemv at 1, 3 and 12 rows),
    # 41 decode-attention items of different lengths.
    from llmopt.runtime.executor.kernels.quant_matmul import int8_scale_shift, pack_int4_q8, pack_int8_q8

    g = torch.Generator().manual_seed(3)
    n, k, group = 37 * 16, 192, 32
    codes, scales_biases = pack_int4_q8(torch.randint(0, 16, (n, k), generator=g),
                                        torch.rand(n, k // group, generator=g) * 0.1 + 0.01,
                                        torch.randint(0, 16, (n, k // group), generator=g).float(), group, group)
    int8_codes = pack_int8_q8(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8))
    int8_scale, int8_shift = int8_scale_shift(torch.rand(n, 1, generator=g) * 0.01 + 0.001,
                                              torch.randint(100, 156, (n, 1), generator=g).float())
    head = torch.randn(4100, 96, generator=g).half()
    lens = [int(v) for v in torch.randint(1, 300, (41,), generator=g)]
    q, k_cache, v_cache, meta = paged_setup(lens, 9, 3, 64, 16, torch.float16)
    for rows in (1, 3, 12, 40):
        x = torch.randn(rows, k, generator=g)
        outputs = thread_counts(lambda: (ops.int4_matmul_q8(x, codes, scales_biases, group, group),
                                         ops.int8_matmul_q8(x, int8_codes, int8_scale, int8_shift, 32),
                                         ops.gemv(x[:, :96], head)))
        for at_more_threads in outputs[1:]:
            for one, more in zip(outputs[0], at_more_threads):
                assert torch.equal(one, more), rows
    attended = thread_counts(lambda: ops.paged_decode_attention(q, k_cache, v_cache, meta.decode.block_tables,
                                                                meta.decode.context_lens, 0.125))
    assert torch.equal(attended[0], attended[1]) and torch.equal(attended[0], attended[2])


def amx_ops(feature="amx_int8"):
    """The build whose AMX kernels run here (avx512_bf16 on a CPU with `feature`: amx_int8 or amx_bf16), else
    None."""
    built = cpu_ops("avx512_bf16") if "avx512_bf16" in supported_kernel_isas() else None
    return built if built is not None and getattr(built, feature)() else None


@pytest.mark.skipif(amx_ops() is None, reason="no AMX-INT8 on this CPU (the VNNI kernel it mirrors is tested above)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,act_group", [(112, 192, 64, 32), (48, 256, 128, 64), (16, 96, 32, 32),
                                                 (80, 384, 32, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 64, 257])
def test_int4_matmul_q8_amx_equals_the_vnni_kernel_bit_for_bit(dtype, n, k, group, act_group, rows):
    # the same integer sums (exact in int32) scaled in the same order: equal, not close; and so, by the test
    # above, exact for its 8-bit inputs. Rows not a multiple of 16: the last tile's padding rows never reach y.
    from llmopt.runtime.executor.kernels.quant_matmul import pack_int4_q8

    ops = amx_ops()
    g = torch.Generator().manual_seed(n + k + rows)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    x = torch.randn(rows, k, generator=g).to(dtype) * 3
    x[0, :act_group] = 0
    codes, scales_biases = pack_int4_q8(q, scales, zeros, group, group)
    out = ops.int4_matmul_q8_amx(x, codes, scales_biases, group, act_group)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert torch.equal(out, ops.int4_matmul_q8(x, codes, scales_biases, group, act_group))


@pytest.mark.skipif(amx_ops("amx_bf16") is None, reason="no AMX-BF16 on this CPU")
@pytest.mark.parametrize("n,k,group", [(112, 192, 64), (48, 256, 128), (16, 96, 32), (80, 1536, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 33, 64, 257])
def test_int4_matmul_amx_bf16_is_the_dequantized_weight_times_the_inputs(n, k, group, rows):
    # the float path's numbers: each weight q * scale + bias rounded once to bf16, products summed in fp32; the
    # only difference left is the order of the fp32 sums and the output's rounding to bf16. Shapes: odd panel
    # counts (the pair loop's single last panel), K = 1536 (row blocks of fewer rows), rows past whole tiles
    from llmopt.runtime.executor.kernels.quant_matmul import pack_int4_q8

    g = torch.Generator().manual_seed(n + k + rows)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    x = torch.randn(rows, k, generator=g).bfloat16()
    codes, scales_biases = pack_int4_q8(q, scales, zeros, group, group)
    out = amx_ops("amx_bf16").int4_matmul_amx_bf16(x, codes, scales_biases, group)
    scale = scales.half().float().repeat_interleave(group, 1)
    bias = (-zeros * scales).half().float().repeat_interleave(group, 1)
    weight = torch.addcmul(bias, q.float(), scale).bfloat16()  # (fused multiply-add, as the kernel)
    expected = x.double() @ weight.double().t()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # within one bf16 rounding of the output (2^-8 relative) plus the fp32 sums' order
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -8, atol=1e-4 * expected.abs().max().item())


def test_the_amx_kernels_refuse_to_run_without_amx(ops):
    from llmopt.runtime.executor.kernels.quant_matmul import pack_int4_q8

    codes, scales_biases = pack_int4_q8(torch.zeros(16, 64, dtype=torch.long), torch.ones(16, 2), torch.zeros(16, 2),
                                        32, 32)
    if ops.amx_int8():
        assert ops.isa() == "avx512_bf16"  # only that build carries the tiles
        with pytest.raises(RuntimeError, match="activation group"):  # and it checks its arguments as the VNNI one
            ops.int4_matmul_q8_amx(torch.randn(1, 64), codes, scales_biases, 32, 48)
    else:
        with pytest.raises(RuntimeError, match="needs AMX-INT8"):
            ops.int4_matmul_q8_amx(torch.randn(1, 64), codes, scales_biases, 32, 32)
    if ops.amx_bf16():
        with pytest.raises(RuntimeError, match="takes bfloat16 inputs"):
            ops.int4_matmul_amx_bf16(torch.randn(1, 64), codes, scales_biases, 32)
    else:
        with pytest.raises(RuntimeError, match="needs AMX-BF16"):
            ops.int4_matmul_amx_bf16(torch.randn(1, 64).bfloat16(), codes, scales_biases, 32)


def test_int4_matmul_q8_refuses_what_its_layout_cannot_hold(ops):
    from llmopt.runtime.executor.kernels.quant_matmul import pack_int4_q8

    q, scales, zeros = torch.zeros(16, 64, dtype=torch.long), torch.ones(16, 2), torch.zeros(16, 2)
    codes, scales_biases = pack_int4_q8(q, scales, zeros, 32, 32)
    with pytest.raises(RuntimeError, match="activation group"):
        ops.int4_matmul_q8(torch.randn(1, 64), codes, scales_biases, 32, 48)


def int8_q8_reference(x, signed, scales, zeros, act_group):
    """int8_matmul_q8's arithmetic in float64: the rounded inputs times the dequantized weight scale * (q - zero) =
    scale * signed + scale * (128 - zero)."""
    weight = scales.double() * (signed.double() + 128 - zeros.double())  # [N, K]
    return q8_rounded_inputs(x, act_group) @ weight.t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,act_group,symmetric", [(112, 192, 32, True), (48, 256, 64, False),
                                                     (16, 96, 32, True), (80, 1536, 32, False)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 64, 257])
def test_int8_matmul_q8_is_exact_for_its_8_bit_inputs(ops, dtype, n, k, act_group, symmetric, rows):
    # 7 and 5 panels: the blocks of 2 (or 4) panels at one row and the single panels after them; codes at both
    # ends (-128 too: its magnitude 128 is still an unsigned byte) and inputs of both signs, where the sign moved
    # from the weight byte onto the input byte could go wrong
    from llmopt.runtime.executor.kernels.quant_matmul import int8_scale_shift, pack_int8_q8

    g = torch.Generator().manual_seed(n + k + rows)
    signed = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    signed[0, :act_group + 8], signed[1, :act_group + 8], signed[2, :act_group + 8] = 127, -127, -128
    scales = torch.rand(n, 1, generator=g) * 0.01 + 0.001
    zeros = torch.full((n, 1), 128.0) if symmetric else torch.randint(100, 156, (n, 1), generator=g).float()
    x = torch.randn(rows, k, generator=g).to(dtype)
    x[-1, act_group:act_group + 8] = x[-1, act_group:act_group + 8].abs().neg() * 100  # -127 inputs x -128 codes
    x[0, :act_group] = 0  # an all-zero block: scale 0, no division by it
    scale, shift = int8_scale_shift(scales, zeros)
    assert (shift is None) == symmetric
    out = ops.int8_matmul_q8(x, pack_int8_q8(signed), scale, shift, act_group)
    expected = int8_q8_reference(x, signed, scales, zeros, act_group)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group,act_group", [(112, 192, 32, 32), (48, 256, 64, 32), (80, 1536, 128, 64),
                                                 (16, 96, 32, 96)])
@pytest.mark.parametrize("rows", [1, 3, 9, 16, 64, 257])
def test_int8_matmul_q8_with_grouped_scales_is_exact_for_its_8_bit_inputs(ops, dtype, n, k, group, act_group,
                                                                         rows):
    # each block's integer sum times its own input scale and its group's weight scale: groups of 1-4 blocks, input
    # groups narrower and wider than the weight's
    from llmopt.runtime.executor.kernels.quant_matmul import int8_group_scales, pack_int8_q8

    g = torch.Generator().manual_seed(n + k + rows + group)
    signed = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    signed[0, :40], signed[1, :40], signed[2, :40] = 127, -127, -128
    scales = torch.rand(n, k // group, generator=g) * 0.01 + 0.001  # (every group its own: a mix-up shows)
    zeros = torch.full((n, k // group), 128, dtype=torch.int32)
    x = torch.randn(rows, k, generator=g).to(dtype)
    x[0, :32] = 0  # an all-zero block
    group_scale = int8_group_scales(scales, zeros)
    assert group_scale.shape == (k // group, n) and group_scale.dtype == torch.float32
    out = ops.int8_matmul_q8(x, pack_int8_q8(signed), group_scale, None, act_group)
    weight = (scales.double().repeat_interleave(group, dim=1) * signed.double())  # [N, K]
    expected = q8_rounded_inputs(x, act_group) @ weight.t()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_grouped_int8_scales_exist_only_for_symmetric_weights():
    from llmopt.runtime.executor.kernels.quant_matmul import int8_group_scales, int8_zeros_symmetric

    zeros = torch.full((16, 2), 128, dtype=torch.int32)
    assert int8_zeros_symmetric(zeros) and int8_group_scales(torch.ones(16, 2), zeros).shape == (2, 16)
    zeros[3, 1] = 127
    assert not int8_zeros_symmetric(zeros) and int8_group_scales(torch.ones(16, 2), zeros) is None


def test_int8_matmul_q8_refuses_what_its_layout_cannot_hold(ops):
    from llmopt.runtime.executor.kernels.quant_matmul import pack_int8_q8

    codes, scale = pack_int8_q8(torch.zeros(16, 64, dtype=torch.int8)), torch.ones(16)
    with pytest.raises(RuntimeError, match="activation group"):
        ops.int8_matmul_q8(torch.randn(1, 64), codes, scale, None, 48)
    with pytest.raises(RuntimeError, match="K matching"):
        ops.int8_matmul_q8(torch.randn(1, 32), codes, scale, None, 32)
    with pytest.raises(RuntimeError, match="scale"):
        ops.int8_matmul_q8(torch.randn(1, 64), codes, scale[:8], None, 32)
    with pytest.raises(RuntimeError, match="shift"):
        ops.int8_matmul_q8(torch.randn(1, 64), codes, scale, scale[:8], 32)
    with pytest.raises(RuntimeError, match="groups of a multiple of 32"):  # (64 columns in 4 groups of 16)
        ops.int8_matmul_q8(torch.randn(1, 64), codes, torch.ones(4, 16), None, 32)
    with pytest.raises(RuntimeError, match="no shift"):
        ops.int8_matmul_q8(torch.randn(1, 64), codes, torch.ones(2, 16), scale, 32)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_tokens_after_a_cached_prefix_attend_as_decode_rows(monkeypatch, dtype, backend):
    """Speculative verification (k + 1 new tokens after a cached prefix) through decode rows, each over the keys up
    to its own position, equals the per-sequence masked attention."""
    new_lens = [1, 6, 3, 2]
    context_lens = [9, 30, 7, 18]
    page, num_heads, num_kv_heads, head_dim = 4, 6, 2, 16
    k_cache, v_cache, tables = triton_paged_setup(context_lens, num_heads, num_kv_heads, head_dim, page, dtype, 5,
                                                  device="cpu")
    starts, slots = [0], []
    for table, ctx, new in zip(tables, context_lens, new_lens):
        starts.append(starts[-1] + new)
        slots += [table[p // page] * page + p % page for p in range(ctx - new, ctx)]
    slots = torch.tensor(slots)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    meta = AttentionMetadata.build(starts, context_lens, tables, slots, page)
    assert not meta.prefills and meta.decode.rows.tolist() == list(range(starts[-1]))
    out = attend(backend, q, k_cache, v_cache, meta, head_dim ** -0.5)
    monkeypatch.setattr(metadata, "MAX_QUERIES_AS_DECODES", 1)
    reference_meta = AttentionMetadata.build(starts, context_lens, tables, slots, page)
    assert len(reference_meta.prefills) == 3
    expected = attend("torch", q, k_cache, v_cache, reference_meta, head_dim ** -0.5)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k", [(1, 576), (3, 100), (70, 64)])  # 70 rows: several threads
def test_w8a8_halves_equal_the_torch_reference_bit_for_bit(ops, dtype, rows, k):
    """W8A8's per-token quantization and int32 epilogue (csrc/int8_cpu.cpp): the same codes, scales and products
    as core.contract.activations and the torch path of the w8a8 linear method."""
    from llmopt.core.contract import INT8_TOKEN_ACTIVATIONS, quantize_activations

    g = torch.Generator().manual_seed(rows + k)
    x = (torch.randn(rows, k, generator=g) * torch.linspace(0.1, 30, k)).to(dtype)
    x[0, 1] = -x[0].abs().max() * 2  # the row's largest magnitude negative (the -128 end of the codes)
    if rows > 2:
        x[2] = 0  # an all-zero row: scale 1, codes 0
    codes, scales = ops.quantize_rows_int8(x)
    expected_codes, expected_scales = quantize_activations(x, INT8_TOKEN_ACTIVATIONS)
    assert torch.equal(codes, expected_codes.reshape(rows, k))
    assert torch.equal(scales, expected_scales.reshape(-1))
    acc = torch.randint(-2 ** 20, 2 ** 20, (rows, 48), generator=g, dtype=torch.int32)
    column = torch.rand(48, generator=g)
    expected = torch.mul(acc, column).mul_(scales.reshape(-1, 1)).to(dtype)
    assert torch.equal(ops.scale_int32_rows(acc, scales, column, dtype), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k,n", [(1, 576, 96), (3, 100, 40), (8, 1536, 64), (5, 64, 7)])  # K tails: 100, 64
def test_int8_gemv_equals_the_integer_matmul_path(ops, dtype, rows, k, n):
    """The decode W8A8 product (csrc/int8_cpu.cpp int8_gemv_rows: VNNI / int16 pairs / scalar per build) equals
    quantize -> exact integer matmul -> epilogue exactly (integer sums are exact)."""
    from llmopt.runtime.executor.linear.w8a8_cpu import exact_int_matmul

    g = torch.Generator().manual_seed(rows * k + n)
    x = (torch.randn(rows, k, generator=g) * 4).to(dtype)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    w_scale = torch.rand(n, generator=g)
    codes, scales = ops.quantize_rows_int8(x)
    expected = ops.scale_int32_rows(exact_int_matmul(codes, w.t()), scales, w_scale, dtype)
    got = ops.int8_gemv_rows(x, w, w_scale, w.sum(dim=1, dtype=torch.int32), dtype)
    assert got.dtype == dtype and torch.equal(got, expected)
