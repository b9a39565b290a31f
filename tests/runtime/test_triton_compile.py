"""Every Triton kernel compiles for the GPUs the runtime targets — Hopper (sm_90), the A100 (sm_80), Ada and the
99 KiB inference parts (sm_89) — at the runtime's launch configurations and fits the block's shared memory:
tests/runtime/triton_targets.py, one process per target (the kernels imported as JIT functions, not under the
interpreter this suite sets). The interpreter runs kernels that a GPU's compiler rejects (a helper returning codes
in one branch and fp32 in another, tl.dot over fewer than 16 keys, FP8 on a chip without it) or cannot place (fp32
tiles needing 288-352 KiB): an H200 found those; this finds them without one."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# (triton is not imported here: a module imported before the suite's kernel tests set TRITON_INTERPRET would give
# them compiled kernels where they expect the interpreter's)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("sm90", "sm80", "sm89")
COMPILE_SECONDS = 900  # ~160 kernels a target, ~2.5 minutes for all three on a 2-core machine


def test_every_kernel_compiles_for_each_target_within_its_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = {t: subprocess.Popen([sys.executable, "-m", "tests.runtime.triton_targets", t], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for t in TARGETS}
    deadline = time.monotonic() + COMPILE_SECONDS
    outputs = {}
    try:
        for target, run in runs.items():
            outputs[target] = run.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"compiling the Triton kernels took over {COMPILE_SECONDS} s")
    finally:
        for run in runs.values():
            run.kill()
    for target, (stdout, stderr) in outputs.items():
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        failed = [f"{target} {r['kernel']} {r['constexprs']} {r['signature']} {r['options']}: {r['error']}"
                  for r in rows if r.get("ok") is False]
        assert not failed, "\n".join(failed)
        assert runs[target].returncode == 0 and rows, stderr[-2000:]
        assert rows[-1]["failed"] == 0 and rows[-1]["compiled"] >= 150
        # every wrapper launched (decode / prefill attention, KV store, W4A16, 2:4, W8A8, FP8 / FP4 weights, fused)
        assert {r["kernel"] for r in rows[:-1]} >= {
            "_decode_split_kernel", "_merge_splits_kernel", "_prefill_kernel", "_store_kv_kernel", "_w4a16_kernel",
            "_sparse24_kernel", "_scaled_mm_kernel", "_float_weight_kernel", "_rms_norm_kernel", "_rotary_kernel",
            "_silu_mul_kernel"}


def test_fp8_methods_are_refused_on_a_gpu_without_fp8(monkeypatch):
    """Triton has no float8e4nv on an A100 (sm_80: the compile check above fails there for the FP8 kernels), so the
    Triton FP8 methods accept only GPUs of compute capability 8.9 and later; others get torch's `fp8-weight` (E4M3 kept
    in memory, widened for each product)."""
    import torch

    from llmopt.core.contract.rounding import quantize_rtn
    from llmopt.core.contract import LinearScheme, preset
    from llmopt.runtime.executor.kernels import triton_support
    from llmopt.runtime.executor.linear import base

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_support, "triton_available", lambda: True)
    cuda = torch.device("cuda", 0)
    w8a8 = preset("w8a8-fp8")
    fp8_inputs = quantize_rtn(torch.randn(32, 64), w8a8.weights)
    fp8_inputs.input_activations = w8a8.input_activations
    fp8_weights = quantize_rtn(torch.randn(32, 64), preset("w8a16-fp8").weights)
    for capability, expected in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert base.fp8_tensor_cores(cuda) is expected
        chosen = [base.select_linear_method(q, LinearScheme(q.scheme, q.input_activations), cuda).name
                  for q in (fp8_inputs, fp8_weights)]
        assert chosen == (["w8a8-triton", "float-weight-triton"] if expected else ["fp8-weight"] * 2), capability
    assert not base.fp8_tensor_cores(torch.device("cpu"))


@pytest.mark.parametrize("shared,stages", [(232448, 3), (166912, 3), (101376, 2), (49152, 2)])
def test_the_2of4_pipeline_is_shallower_where_shared_memory_is_small(shared, stages):
    from llmopt.runtime.executor.kernels.triton_sparse24 import pipeline_stages

    assert pipeline_stages(shared) == stages
