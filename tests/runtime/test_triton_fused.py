"""The Triton fused element-wise ops (kernels/triton_fused.py: the fast path's RMSNorm, residual add + RMSNorm,
rotary embedding and silu * up on CUDA) against the torch ops they replace, and a model's fast path run on them.

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported);
scripts/gpu_check.sh runs this file on CUDA.
"""

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmopt.runtime.executor.kernels.triton_fused import TritonFusedOps
from llmopt.runtime.executor.models.layers import RMSNorm, rotate_half

DEVICE = "cuda" if CUDA else "cpu"
# bf16 on a GPU only: Triton's interpreter rounds fp32 -> bf16 toward zero (GPUs: to nearest even, as torch)
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="the interpreter truncates to bf16"))]


def tolerance(dtype):
    """The kernels sum the squares in another order than torch's mean, so a normalized value can round to the
    neighbouring step of the storage dtype, and its product with the weight once more: two steps at most."""
    step = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    return {"rtol": 2 * step if dtype != torch.float32 else 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 72), (3, 1000)])
def test_rms_norm_and_the_residual_add_before_it_match_the_torch_ops(dtype, rows, hidden):
    g = torch.Generator().manual_seed(hidden)
    h = torch.randn(rows, hidden, generator=g).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    norm = RMSNorm((1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype), 1e-6)
    ops = TritonFusedOps()
    out = ops.rms_norm(h.to(DEVICE), norm.weight.to(DEVICE), norm.eps)
    torch.testing.assert_close(out.cpu(), norm(h), **tolerance(dtype))
    residual = h.clone().to(DEVICE)
    out = ops.add_rms_norm_(residual, delta.to(DEVICE), norm.weight.to(DEVICE), norm.eps)
    assert torch.equal(residual.cpu(), h + delta)  # the residual stream as `h = h + delta` leaves it
    torch.testing.assert_close(out.cpu(), norm(h + delta), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 24)])
def test_rotary_rotates_q_and_k_in_place_and_leaves_v(dtype, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    rows = 3
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.randn(rows, head_dim // 2, generator=g)
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    expected = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    out = qkv.clone().to(DEVICE)
    TritonFusedOps().rotary_(out, cos.to(DEVICE), sin.to(DEVICE), heads + kv_heads)
    out = out.cpu()
    # each product and the sum rounded to the storage dtype as the torch ops round them: equal
    assert torch.equal(out[:, : (heads + kv_heads) * head_dim].view_as(expected), expected)
    assert torch.equal(out[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (4, 100), (2, 2500)])
def test_silu_mul_matches_the_torch_ops(dtype, rows, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = TritonFusedOps().silu_mul(gate_up.to(DEVICE)).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def test_a_cuda_model_takes_the_triton_ops_and_keeps_its_own_lm_head(monkeypatch):
    from llmopt.runtime.executor import platform

    monkeypatch.setattr(platform, "triton_available", lambda: True)
    assert isinstance(platform.Platform.of(torch.device("cuda")).fused_ops(), TritonFusedOps)
    monkeypatch.setattr(platform, "triton_available", lambda: False)
    assert platform.Platform.of(torch.device("cuda")).fused_ops() is None  # (the torch ops)
    assert not hasattr(TritonFusedOps, "gemv")  # so the model keeps _gemv_weight None: its lm_head's method


def test_the_fused_path_is_the_default_wherever_fused_kernels_exist(monkeypatch):
    from llmopt.runtime.executor import platform

    monkeypatch.setattr(platform, "triton_available", lambda: True)
    assert platform.Platform.of("cuda").fast_by_default and platform.Platform.of("cpu").fast_by_default
    monkeypatch.setattr(platform, "triton_available", lambda: False)
    assert not platform.Platform.of("cuda").fast_by_default  # (the exact path: the torch ops either way)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_fast_path_on_the_triton_ops_generates_what_the_compiled_ops_do(tiny_llama_dir, dtype):
    """The model's fused forward (`_forward_fused`) with the Triton ops in place of the compiled CPU ones (here in
    Triton's interpreter, on CPU tensors): the same greedy tokens and logits within rounding."""
    from llmopt.runtime.engine.engine import Engine, EngineConfig
    from llmopt.runtime.engine.sampling import SamplingParams
    from llmopt.runtime.executor.loader import load_runtime_model

    def run(triton_ops: bool):
        checkpoint, tok, _ = load_runtime_model(str(tiny_llama_dir), dtype=dtype, activations="float")
        engine = Engine(checkpoint, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, activations="float",
                                                      decode_graph=False))
        decoder = engine.runner.decoder
        assert decoder.fused_ops is not None
        if triton_ops:
            decoder.fused_ops, decoder._gemv_weight = TritonFusedOps(), None
        params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
        return engine.generate([[5, 9, 200, 31], list(range(40, 77))], params)

    compiled, triton_run = run(False), run(True)
    assert [o.token_ids for o in triton_run] == [o.token_ids for o in compiled]
    tol = 1e-4 if dtype == "float32" else 0.05
    for a, b in zip(triton_run, compiled):
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert step_a.keys() == step_b.keys()
            for token in step_a:
                assert abs(step_a[token] - step_b[token]) < tol
