"""The 8-bit KV cache (--kv-cache-dtype int8 | fp8): its numbers (kernels/kv_quant.py), the compiled CPU store and
decode kernels in every build this CPU runs, the Triton kernels (in the interpreter without a GPU), and the
engine: greedy tokens against the full-precision cache, and chunked prefill, prefix-cache hits, preemption and
speculative decoding unchanged by it."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmopt.core.errors import ConfigError  # noqa: E402
from llmopt.core.hardware import supported_kernel_isas  # noqa: E402
from llmopt.core.tiny import build_tiny_model  # noqa: E402
from llmopt.runtime.engine.engine import Engine, EngineConfig  # noqa: E402
from llmopt.runtime.engine.sampling import SamplingParams  # noqa: E402
from llmopt.runtime.executor.attention.kv_cache import KVCacheSpec  # noqa: E402
from llmopt.runtime.executor.attention import AttentionMetadata  # noqa: E402
from llmopt.runtime.executor.attention.torch_sdpa import TILED_MIN_CHUNK  # noqa: E402
from llmopt.runtime.executor.attention.torch_sdpa import store_kv as reference_store_kv  # noqa: E402
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops  # noqa: E402
from llmopt.runtime.executor.kernels.kv_quant import dequantize_kv, quantize_kv  # noqa: E402
from tests.runtime.attention_calls import attend  # noqa: E402
from tests.runtime.test_engine import prompts, token_ids  # noqa: E402
from tests.runtime.test_triton_kernels import DEVICE, paged_setup  # noqa: E402

CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]
ALL_E4M3 = [c for c in range(256) if c & 0x7F != 0x7F]  # every finite E4M3 code


@pytest.fixture(params=supported_kernel_isas())
def ops(request):
    built = cpu_ops(request.param)
    assert built is not None, f"the {request.param} kernels failed to build"
    return built


def test_quantize_kv_error_is_bounded_per_vector():
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[0, 1] = 0  # a vector of zeros: scale 0, values 0
    for dtype, bound in ((torch.int8, 0.5 / 127), (torch.float8_e4m3fn, 1 / 16)):
        codes, scales = quantize_kv(x, dtype)
        assert codes.dtype == dtype and scales.shape == (50, 3) and scales.dtype == torch.float32
        back = dequantize_kv(codes, scales, torch.float32)
        amax = x.abs().amax(-1, keepdim=True)
        if dtype == torch.int8:  # uniform grid: half a step of amax / 127
            assert ((back - x).abs() <= bound * amax * 1.0001 + 1e-12).all()
        else:  # 3 mantissa bits: relative error <= 2^-4 above the subnormals
            normal = x.abs() >= amax / 448 * 2 ** -6
            assert ((back - x).abs()[normal] <= bound * x.abs()[normal] * 1.0001).all()
        assert back[0, 1].eq(0).all() and scales[0, 1] == 0
        torch.testing.assert_close(back.abs().amax(-1), amax[..., 0])  # amax itself is stored exactly


def quantized_caches(context_lens, num_kv_heads, head_dim, page, dtype, kv_dtype, device="cpu", seed=0):
    """paged_setup's caches in 8 bits: (k codes, v codes, k scales, v scales) and the block tables."""
    k_full, v_full, tables = paged_setup(context_lens, 1, num_kv_heads, head_dim, page, dtype, seed, device="cpu")
    spec = KVCacheSpec("kv", 1, kv_dtype, num_kv_heads=num_kv_heads, head_dim=head_dim)
    cache = spec.allocate(k_full.shape[0], page, torch.device("cpu"))[0]
    slots = torch.arange(k_full.shape[0] * page)
    reference_store_kv(k_full.reshape(-1, num_kv_heads, head_dim) * 3, v_full.reshape(-1, num_kv_heads, head_dim),
                       cache[0], cache[1], slots, (cache[2], cache[3]))
    return tuple(t.to(device) for t in cache), tables


@pytest.mark.parametrize("head_dim", [24, 64], ids=["scalar", "vector"])  # int8 rows of 16k values are vectorized
@pytest.mark.parametrize("kv_dtype", CODE_DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_store_writes_the_reference_codes_and_scales(ops, kv_dtype, dtype, head_dim):
    spec = KVCacheSpec("kv", 1, kv_dtype, num_kv_heads=3, head_dim=head_dim)
    expected, got = (spec.allocate(6, 4, torch.device("cpu"))[0] for _ in range(2))
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(19, 3, head_dim, generator=g) * 5).to(dtype)
    v = torch.randn(19, 3, head_dim, generator=g).to(dtype)
    k[3, 1] = 0
    slots = torch.randperm(24, generator=g)[:19]
    reference_store_kv(k, v, expected[0], expected[1], slots, (expected[2], expected[3]))
    ops.store_kv_quantized_(got[0], got[1], got[2], got[3], k, v, slots)
    for a, b in zip(expected, got):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)


@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("kv_dtype", CODE_DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fused_store_writes_the_reference_codes_and_scales(kv_dtype, dtype, head_dim, monkeypatch):
    """One launch quantizes and stores (nothing quantized in torch): k and v as views into a qkv row, a zero vector,
    values on a code's half step, a skipped (negative) slot."""
    from llmopt.runtime.executor.kernels import triton_store_kv

    spec = KVCacheSpec("kv", 1, kv_dtype, num_kv_heads=3, head_dim=head_dim)
    expected, got = (spec.allocate(6, 4, torch.device("cpu"))[0] for _ in range(2))
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(19, 9 * head_dim, generator=g).to(dtype)  # [T, (3 q + 3 k + 3 v) heads * D]
    k, v = qkv[:, 3 * head_dim:6 * head_dim].view(19, 3, head_dim), qkv[:, 6 * head_dim:].view(19, 3, head_dim)
    k.mul_(5)
    k[3, 1] = 0
    v[4, 0, :2] = torch.tensor([127.0, 0.5])  # scale 1: 0.5 lies half-way between codes 0 and 1 (even: 0)
    slots = torch.randperm(24, generator=g)[:19]
    slots[7] = -1
    kept = slots >= 0
    reference_store_kv(k[kept], v[kept], expected[0], expected[1], slots[kept], (expected[2], expected[3]))
    monkeypatch.setattr(triton_store_kv, "quantize_kv", None)  # (the torch quantizer must not run)
    triton_store_kv.store_kv(k, v, got[0], got[1], slots, (got[2], got[3]))
    for a, b in zip(expected, got):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)


DECODE_SHAPES = [
    ([5], 4, 2, 16, 4),  # scalar path (head_dim 16)
    ([1, 17, 33], 6, 2, 24, 8),  # scalar path, odd head_dim
    ([40, 3, 16, 31, 64], 9, 3, 64, 16),  # SmolLM2's heads, whole sequences per item
    ([70], 8, 1, 64, 16),  # group 8, one KV head per item
    ([100, 7], 4, 4, 128, 16),  # no GQA, head_dim 128
    ([70, 33, 100], 9, 3, 64, 32),  # block size 32: two groups of 16 rows a block
    ([20] * 6, 18, 2, 64, 16),  # group 9: the scalar path
    ([3000], 9, 3, 64, 16),  # one long context: split across threads, the splits merged
    ([2100, 40], 6, 2, 24, 8),  # split, scalar path; the short sequence's second split is empty
]


@pytest.mark.parametrize("context_lens,num_heads,num_kv_heads,head_dim,page", DECODE_SHAPES)
@pytest.mark.parametrize("kv_dtype", CODE_DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_reads_8bit_blocks_like_the_reference(ops, context_lens, num_heads, num_kv_heads, head_dim,
                                                              page, kv_dtype, dtype):
    cache, tables = quantized_caches(context_lens, num_kv_heads, head_dim, page, dtype, kv_dtype)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    meta = AttentionMetadata.build(list(range(len(context_lens) + 1)), context_lens, tables,
                                   torch.zeros(len(context_lens), dtype=torch.long), page)
    scale = head_dim ** -0.5
    expected = attend("torch", q.float(), cache[0], cache[1], meta, scale, scales=cache[2:])
    out = ops.paged_decode_attention_quantized(q, cache[0].view(torch.uint8), cache[1].view(torch.uint8), cache[2],
                                               cache[3], meta.decode.block_tables, meta.decode.context_lens, scale,
                                               kv_dtype == torch.float8_e4m3fn)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def one_token_of_every_e4m3_code():
    """An fp8 cache whose one token's value rows hold every finite E4M3 code (scale 1): attention over a single
    token returns its value row, so the output is each code decoded."""
    codes = torch.tensor(ALL_E4M3 + [0] * (256 - len(ALL_E4M3)), dtype=torch.uint8).view(4, 64)  # 4 KV heads
    v = codes.view(torch.float8_e4m3fn).view(1, 1, 4, 64)
    k = torch.zeros_like(v)
    scales = torch.ones(1, 1, 4)
    return k, v, scales, codes.view(torch.float8_e4m3fn).float()


def test_every_e4m3_code_decodes_as_torch_does(ops):
    k, v, scales, expected = one_token_of_every_e4m3_code()
    q = torch.randn(1, 4, 64)
    out = ops.paged_decode_attention_quantized(q, k.view(torch.uint8), v.view(torch.uint8), scales, scales,
                                               torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                                               0.125, True)
    assert torch.equal(out[0], expected)


def test_triton_kernels_decode_every_e4m3_code():
    from llmopt.runtime.executor.kernels.triton_decode_attention import decode_attention

    k, v, scales, expected = one_token_of_every_e4m3_code()
    q = torch.randn(1, 4, 64)
    out = decode_attention(*(t.to(DEVICE) for t in (q, k, v)), torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
                           torch.ones(1, dtype=torch.int32, device=DEVICE), 0.125,
                           scales=(scales.to(DEVICE), scales.to(DEVICE)))
    assert torch.equal(out[0].cpu(), expected)


@pytest.mark.parametrize("kv_dtype", CODE_DTYPES, ids=["int8", "fp8"])
def test_triton_store_and_attention_over_8bit_caches_match_the_reference(kv_dtype):
    from llmopt.runtime.executor.kernels.triton_decode_attention import decode_attention
    from llmopt.runtime.executor.kernels.triton_prefill_attention import prefill_attention
    from llmopt.runtime.executor.kernels.triton_store_kv import store_kv as triton_store_kv

    context_lens, num_heads, num_kv_heads, head_dim, page = [9, 30, 17], 6, 2, 32, 8
    cache, tables = quantized_caches(context_lens, num_kv_heads, head_dim, page, torch.float32, kv_dtype)
    # store: the same codes and scales as the reference
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(5, num_kv_heads, head_dim, generator=g), torch.randn(5, num_kv_heads, head_dim, generator=g)
    slots = torch.tensor([0, 9, 10, 31, 2])
    expected = [t.clone() for t in cache]
    reference_store_kv(k, v, expected[0], expected[1], slots, (expected[2], expected[3]))
    stored = [t.clone().to(DEVICE) for t in cache]
    triton_store_kv(k.to(DEVICE), v.to(DEVICE), stored[0], stored[1], slots.to(DEVICE), (stored[2], stored[3]))
    for a, b in zip(expected, stored):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           (b.view(torch.uint8) if b.dtype != torch.float32 else b).cpu())
    # decode and a prefill of the last 4 tokens of each sequence, against the torch path
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=g)
    meta = AttentionMetadata.build(list(range(len(context_lens) + 1)), context_lens, tables,
                                   torch.zeros(len(context_lens), dtype=torch.long), page)
    dev = [t.to(DEVICE) for t in cache]
    want = attend("torch", q, cache[0], cache[1], meta, head_dim ** -0.5, scales=cache[2:])
    got = decode_attention(q.to(DEVICE), dev[0], dev[1], block_tables.to(DEVICE), lens.to(DEVICE),
                           head_dim ** -0.5, scales=tuple(dev[2:]))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    starts = [0, 4, 8, 12]
    qp = torch.randn(12, num_heads, head_dim, generator=g)
    meta = AttentionMetadata.build(starts, context_lens, tables, torch.zeros(12, dtype=torch.long), page)
    want = attend("torch", qp, cache[0], cache[1], meta, head_dim ** -0.5, scales=cache[2:])
    got = prefill_attention(qp.to(DEVICE), dev[0], dev[1], torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                            lens.to(DEVICE), block_tables.to(DEVICE), head_dim ** -0.5, 4, block_m=16,
                            scales=tuple(dev[2:]))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [None, *CODE_DTYPES], ids=["fp32", "int8", "fp8"])
def test_prefill_after_a_cached_prefix_needs_no_chunk_square_mask(kv_dtype):
    """The tiled path (prefix without a mask + the chunk causally, merged by log-sum-exp) equals one masked SDPA
    over the gathered blocks; an 8-bit cache's new keys are taken as the cache holds them."""
    context_lens, num_heads, num_kv_heads, head_dim, page = [200, 190], 6, 2, 32, 8
    new = [TILED_MIN_CHUNK + 20, TILED_MIN_CHUNK]  # the tiled path (shorter chunks take the masked one)
    if kv_dtype is None:
        k_cache, v_cache, tables = paged_setup(context_lens, 1, num_kv_heads, head_dim, page, torch.float32,
                                               device="cpu")
        scales = None
    else:
        cache, tables = quantized_caches(context_lens, num_kv_heads, head_dim, page, torch.float32, kv_dtype)
        k_cache, v_cache, scales = cache[0], cache[1], cache[2:]
    g = torch.Generator().manual_seed(5)
    starts = [0, new[0], new[0] + new[1]]
    # this step's keys: the full-precision values whose codes the cache holds (the last `new` of each sequence)
    k_new, v_new = [], []
    for table, ctx, n in zip(tables, context_lens, new):
        slots = torch.tensor([table[p // page] * page + p % page for p in range(ctx - n, ctx)])
        for out, c, s in ((k_new, k_cache, None if scales is None else scales[0]),
                          (v_new, v_cache, None if scales is None else scales[1])):
            rows = c.view(torch.uint8).view(-1, *c.shape[2:])[slots].view(c.dtype) if scales is not None else (
                c.view(-1, *c.shape[2:])[slots])
            out.append(rows.float() if s is None else dequantize_kv(rows, s.view(-1, num_kv_heads)[slots],
                                                                   torch.float32))
    k_new, v_new = torch.cat(k_new), torch.cat(v_new)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=g)
    meta = AttentionMetadata.build(starts, context_lens, tables, torch.zeros(starts[-1], dtype=torch.long), page)
    assert len(meta.prefills) == 2 and meta.decode is None
    masked = attend("torch", q, k_cache, v_cache, meta, head_dim ** -0.5, scales=scales)
    tiled = attend("torch", q, k_cache, v_cache, meta, head_dim ** -0.5, k_new, v_new, scales=scales)
    torch.testing.assert_close(tiled, masked, rtol=1e-5, atol=1e-5)


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    return build_tiny_model(request.param, seed=0)


def prompt_logprobs(engine, ps):
    outputs = engine.generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return torch.tensor([next(iter(e.values())) for o in outputs for e in o.prompt_logprobs[1:]])


@pytest.mark.parametrize("fast_path", [True, False], ids=["compiled", "torch"])
def test_int8_cache_keeps_greedy_tokens_and_fp8_stays_close(tiny, fast_path):
    """int8: the same greedy tokens as the full-precision cache. fp8 (3 mantissa bits) flips near-ties of these
    random models' flat distributions, so it is held to its prompt log-probabilities (int8's too)."""
    model, tok = tiny
    ps = prompts()
    full = token_ids(Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, fast_path=fast_path))
                     .generate(ps, GREEDY))
    int8 = Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, kv_cache_dtype="int8",
                                           fast_path=fast_path))
    assert int8.runner.kv_cache[0][0].dtype == torch.int8
    assert token_ids(int8.generate(ps, GREEDY)) == full
    fp8 = Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, kv_cache_dtype="fp8",
                                          fast_path=fast_path))
    reference = prompt_logprobs(Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20,
                                                                fast_path=fast_path)), ps)
    for engine, worst, mean in ((int8, 0.03, 0.006), (fp8, 0.2, 0.03)):  # nats (measured: 0.017 / 0.0034, 0.10 / 0.019)
        error = (prompt_logprobs(engine, ps) - reference).abs()
        assert error.max() < worst and error.mean() < mean


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("variant", [
    {"max_num_batched_tokens": 7},  # chunked prefill
    {"block_size": 2, "cache_tokens": 100},  # a tiny cache: preemption
    {"speculative": "ngram"},
], ids=["chunked", "preempt", "speculative"])
def test_8bit_cache_outputs_do_not_depend_on_scheduling(tiny, kv_cache_dtype, variant):
    from llmopt.runtime.engine.config import SpeculativeConfig

    model, tok = tiny
    ps = [p * 2 for p in prompts(seed=1)]  # repeats: n-gram drafts get accepted and rejected
    base = {"block_size": 4, "kv_cache_bytes": 2**20, "kv_cache_dtype": kv_cache_dtype}
    reference = token_ids(Engine(model, tok, EngineConfig(**base)).generate(ps, GREEDY))
    config = {**base, **variant}
    if "cache_tokens" in variant:  # room for the longest request (92 tokens), not for all at once
        per_token = Engine(model, tok, EngineConfig(**base)).runner.kv_cache_spec.bytes_per_token
        config["kv_cache_bytes"] = config.pop("cache_tokens") * per_token
    if variant.get("speculative"):
        config["speculative"] = SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False)
    engine = Engine(model, tok, EngineConfig(**config))
    assert token_ids(engine.generate(ps, GREEDY)) == reference
    stats = engine.stats()
    if "block_size" in variant:
        assert stats.num_preemptions > 0
    if "speculative" in variant:
        assert stats.spec_decode.num_draft_tokens > stats.spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_8bit_cache_prefix_hits_give_the_same_tokens(tiny, kv_cache_dtype):
    model, tok = tiny
    shared = prompts(1, seed=2)[0] * 2
    ps = [shared + [i] for i in range(4)]
    cold = [Engine(model, tok, EngineConfig(block_size=4, enable_prefix_cache=False, kv_cache_dtype=kv_cache_dtype))
            .generate([p], GREEDY)[0].token_ids for p in ps]
    engine = Engine(model, tok, EngineConfig(block_size=4, max_num_seqs=1, kv_cache_dtype=kv_cache_dtype))
    assert token_ids(engine.generate(ps, GREEDY)) == cold
    assert engine.stats().prefix_cache_hits > 0


def test_8bit_cache_holds_more_tokens_in_the_same_bytes(tiny):
    model, tok = tiny
    budget = 2**20
    engines = {d: Engine(model, tok, EngineConfig(block_size=16, kv_cache_bytes=budget, kv_cache_dtype=d))
               for d in ("float32", "bfloat16", "int8", "fp8")}
    spec = engines["float32"].runner.kv_cache_spec
    head_dim = spec.head_dim
    tokens = {d: e.kv_cache_info()["tokens"] for d, e in engines.items()}
    # bytes per token and layer: 2 x kv_heads x (head_dim values + one fp32 scale) in 8 bits
    ratio_vs_fp32 = (4 * head_dim) / (head_dim + 4)
    assert tokens["int8"] == tokens["fp8"]
    assert tokens["int8"] / tokens["float32"] == pytest.approx(ratio_vs_fp32, rel=0.02)
    assert tokens["int8"] / tokens["bfloat16"] == pytest.approx(ratio_vs_fp32 / 2, rel=0.02)
    info = engines["int8"].kv_cache_info()
    assert info["dtype"] == "int8" and info["tokens_per_dtype"]["float32"] == tokens["float32"]
    assert "in int8" in info["summary"] and f"{tokens['float32']:,} in float32" in info["summary"]
    assert engines["fp8"].numerics()["kv_cache_dtype_resolved"] == "fp8"


def test_kv_cache_dtype_spellings_and_refusals(tiny):
    assert EngineConfig(kv_cache_dtype="fp32").kv_cache_dtype == "float32"
    assert EngineConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"
    assert EngineConfig(kv_cache_dtype="int8").quantized_kv_cache
    with pytest.raises(ConfigError, match="kv-cache-dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


def test_latent_caches_refuse_8bit_by_name():
    from llmopt.core.tiny import build_tiny_model as build

    model, tok = build("deepseek", seed=0)
    with pytest.raises(ConfigError, match="no attention backend runs an 8-bit latent cache"):
        Engine(model, tok, EngineConfig(kv_cache_dtype="int8", kv_cache_bytes=2**20))


# measured: int8 0.0010 (decode) / 0.0021 (chunk), fp8 0.0048 / 0.011 of the values' largest magnitude
@pytest.mark.parametrize("kv_dtype,tolerance", [(torch.int8, 0.005), (torch.float8_e4m3fn, 0.025)],
                         ids=["int8", "fp8"])
def test_store_then_attend_stays_within_the_codes_precision_of_full_precision(kv_dtype, tolerance):
    """The same keys and values stored in fp32 and in 8 bits, attended by the same queries (decode rows and a
    prefill chunk after a prefix): outputs differ by at most `tolerance` x the values' largest magnitude (int8: steps
    of 1/127 of each vector's amax; fp8: 3 mantissa bits)."""
    num_kv_heads, head_dim, page, ctx = 2, 64, 16, 90
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(ctx, num_kv_heads, head_dim, generator=g), torch.randn(ctx, num_kv_heads, head_dim, generator=g)
    slots = torch.arange(ctx)
    full = KVCacheSpec("kv", 1, torch.float32, num_kv_heads=num_kv_heads, head_dim=head_dim).allocate(
        6, page, torch.device("cpu"))[0]
    q8 = KVCacheSpec("kv", 1, kv_dtype, num_kv_heads=num_kv_heads, head_dim=head_dim).allocate(
        6, page, torch.device("cpu"))[0]
    reference_store_kv(k, v, full[0], full[1], slots)
    reference_store_kv(k, v, q8[0], q8[1], slots, (q8[2], q8[3]))
    table = [list(range(6))]
    for starts, lens in (([0, 1], [ctx]), ([0, 30], [ctx])):  # a decode; the last 30 tokens as a chunk
        n = starts[-1]
        q = torch.randn(n, 6, head_dim, generator=g)
        meta = AttentionMetadata.build(starts, lens, table, slots[ctx - n:], page)
        new = (k[ctx - n:], v[ctx - n:])
        want = attend("torch", q, full[0], full[1], meta, head_dim ** -0.5, *new)
        for backend in ("torch", "cpu"):
            got = attend(backend, q, q8[0], q8[1], meta, head_dim ** -0.5, *new, scales=q8[2:])
            assert (got - want).abs().max() / v.abs().max() < tolerance


def test_triton_fused_store_rounds_every_e4m3_value_and_half_step_as_torch_does():
    """The fused FP8 store computes E4M3 codes from the bits: every finite E4M3 value, every half-step between two
    neighbours (ties to even) and the floats just either side of it, both signs, -0 and fp32 subnormals, under a
    scale of exactly 1 (each vector's amax 448), give the bytes torch's float8_e4m3fn conversion gives."""
    from llmopt.runtime.executor.kernels.triton_store_kv import store_kv_quantized

    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = values[torch.isfinite(values) & (values >= 0)].unique()
    halves = (grid[1:] + grid[:-1]) / 2
    below, above = torch.nextafter(halves, torch.tensor(0.0)), torch.nextafter(halves, torch.tensor(1e9))
    magnitudes = torch.cat([grid, halves, below, above, torch.tensor([1e-40])])
    x = torch.cat([magnitudes, -magnitudes, torch.tensor([-0.0])])
    head_dim = 64
    x = torch.cat([x, torch.zeros(-x.numel() % (head_dim - 1))]).view(-1, head_dim - 1)
    x = torch.cat([x, torch.full((x.shape[0], 1), 448.0)], dim=1)  # [T, 64]: scale 448 / 448 = 1
    tokens = x.shape[0]
    k = x.view(tokens, 1, head_dim)
    cache = torch.zeros(tokens, 1, 1, head_dim, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(tokens, 1, 1)
    store_kv_quantized(k, k.clone(), cache, cache.clone(), scales, scales.clone(), torch.arange(tokens))
    assert torch.equal(scales, torch.ones_like(scales))
    assert torch.equal(cache.view(torch.uint8).view(tokens, head_dim), x.to(torch.float8_e4m3fn).view(torch.uint8))
