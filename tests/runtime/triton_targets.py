"""Every Triton kernel the runtime launches, compiled for a GPU without one: the kernel wrappers are called on CPU
tensors at the runtime's shapes with the launches recorded instead of run, and each recorded launch (argument
types, constexprs, launch options) is compiled by Triton's CUDA backend (ptxas ships with Triton) for one target.
What a GPU showed and Triton's interpreter does not: compile errors (types, tl.dot's least sizes, FP8 types a chip
lacks) and shared memory beyond what one block may take.

Run as `python -m tests.runtime.triton_targets TARGET` (tests/runtime/test_triton_compile.py runs every target, each
in a process of its own: the kernels must be imported without TRITON_INTERPRET). Prints one JSON line per kernel.
"""

from __future__ import annotations

import json
import os
import sys

import torch

# name -> (compute capability, the most shared memory one block may take, FP8 arithmetic)
TARGETS = {
    "sm90": (90, 232448, True),  # H100 / H200: 227 KiB
    "sm80": (80, 166912, False),  # A100: 163 KiB, no float8e4nv
    "sm89": (89, 101376, True),  # L4, RTX 40xx (and sm86's A10 / RTX 30xx: the same 99 KiB): 99 KiB
}
FP8_LAUNCHES = [False]  # set while the FP8 wrappers run: their launches are compiled for FP8 targets only
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
         torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1"}


def record_launches() -> list:
    """Replace JITFunction.run (what `kernel[grid](...)` calls) by a recorder; returns the list it fills."""
    from triton.runtime.jit import JITFunction

    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs, FP8_LAUNCHES[0]))

    JITFunction.run = record
    return launches


def signature(fn, args, kwargs) -> tuple[dict, dict, dict]:
    """Triton's signature ({name: type}), constexprs ({name: value}) and launch options (num_stages, num_warps) of
    one recorded launch."""
    names = [p.name for p in fn.params]
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}
    sig, constexprs = {}, {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr:
            sig[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[param.name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[param.name] = "i1"
        elif isinstance(value, int):
            sig[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[param.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {param.name} of type {type(value).__name__}")
    return sig, constexprs, options


def launch_every_kernel() -> None:
    """Each wrapper at the shapes the runtime gives it (SmolLM2-135M's: 9 / 3 heads of 64, hidden 576; attention
    and the fused ops at Llama-3-8B's too: 32 / 8 heads of 128, hidden 4096), in fp32, fp16 and bf16, at decode
    (1 row) and batch (64 rows) tiles, with float and 8-bit KV caches."""
    from llmopt.runtime.executor.kernels.triton_decode_attention import decode_attention
    from llmopt.runtime.executor.kernels.triton_fused import TritonFusedOps
    from llmopt.runtime.executor.kernels.triton_lowprec import float_weight_matmul, scaled_matmul
    from llmopt.runtime.executor.kernels.triton_prefill_attention import prefill_attention
    from llmopt.runtime.executor.kernels.triton_sparse24 import sparse24_matmul
    from llmopt.runtime.executor.kernels.triton_store_kv import store_kv
    from llmopt.runtime.executor.kernels.triton_w4a16 import w4a16_matmul

    caches = [(dt, None) for dt in (torch.float32, torch.float16, torch.bfloat16)]
    caches += [(torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")]
    for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128)):  # SmolLM2's attention, and Llama-3-8B's
        for page, (cache_dtype, code) in ((p, c) for p in (16, 8) for c in caches):
            k = torch.zeros(8, page, kv_heads, head_dim, dtype=cache_dtype)
            scales = (torch.ones(8, page, kv_heads), torch.ones(8, page, kv_heads)) if code else None
            q_dtype = torch.float16 if code else cache_dtype
            tables = torch.zeros(2, 4, dtype=torch.int32)
            lens = torch.tensor([40, 17], dtype=torch.int32)
            decode_attention(torch.zeros(2, heads, head_dim, dtype=q_dtype), k, k.clone(), tables, lens, 0.125,
                             scales=scales)
            for block_m in (16, 64):  # (attention.triton_paged_attention's two prefill tiles)
                prefill_attention(torch.zeros(8, heads, head_dim, dtype=q_dtype), k, k.clone(),
                                  torch.tensor([0, 4, 8], dtype=torch.int32), lens, tables, 0.125, 4, block_m=block_m,
                                  scales=scales)
            new = torch.zeros(3, kv_heads, head_dim, dtype=q_dtype)
            store_kv(new, new, k, k.clone(), torch.tensor([0, 5, 9]), scales)
    heads, kv_heads, head_dim, hidden = 9, 3, 64, 576
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows in (1, 64):
            x = torch.zeros(rows, hidden, dtype=dtype)
            for group in (32, 64, 128, hidden, 4096):  # (4096: a per-channel scale of Llama-3-8B's hidden width)
                groups = -(-hidden // group)
                w4a16_matmul(x, torch.zeros(hidden // 8, 1536, dtype=torch.int32),
                             torch.ones(groups, 1536, dtype=dtype), torch.zeros(groups, 1536, dtype=dtype), group)
            positions = torch.zeros(hidden // 32, 1536, dtype=torch.int32)
            sparse24_matmul(x, positions, torch.zeros(hidden // 2, 1536, dtype=dtype))
            for group in (64, 128):
                groups = -(-hidden // group)
                sparse24_matmul(x, positions, torch.zeros(hidden // 16, 1536, dtype=torch.int32),
                                torch.ones(groups, 1536, dtype=dtype), torch.zeros(groups, 1536, dtype=dtype), group)
            float_weight_matmul(x, torch.zeros(1536, hidden // 2, dtype=torch.uint8),
                                torch.zeros(1536, hidden // 16, dtype=torch.uint8), 16, torch.ones(256))
            scaled_matmul(torch.zeros(rows, hidden, dtype=torch.int8), torch.zeros(1536, hidden, dtype=torch.int8),
                          torch.ones(rows), torch.ones(1536), dtype)
            FP8_LAUNCHES[0] = True  # (the runtime's FP8 methods accept FP8 GPUs only: linear.base.fp8_tensor_cores)
            float_weight_matmul(x, torch.zeros(1536, hidden, dtype=torch.float8_e4m3fn), torch.ones(1536, 1), hidden)
            scaled_matmul(torch.zeros(rows, hidden, dtype=torch.float8_e4m3fn),
                          torch.zeros(1536, hidden, dtype=torch.float8_e4m3fn), torch.ones(rows), torch.ones(1536),
                          dtype)
            FP8_LAUNCHES[0] = False
            ops = TritonFusedOps()
            weight = torch.ones(hidden, dtype=dtype)
            ops.rms_norm(x, weight, 1e-6)
            ops.add_rms_norm_(x.clone(), x, weight, 1e-6)
            ops.rotary_(torch.zeros(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype),
                        torch.ones(rows, head_dim, dtype=dtype), torch.zeros(rows, head_dim, dtype=dtype),
                        heads + kv_heads)
            ops.silu_mul(torch.zeros(rows, 2 * 1536, dtype=dtype))
            ops.rms_norm(torch.zeros(rows, 4096, dtype=dtype), torch.ones(4096, dtype=dtype), 1e-6)
            ops.rotary_(torch.zeros(rows, 48 * 128, dtype=dtype), torch.ones(rows, 128, dtype=dtype),
                        torch.zeros(rows, 128, dtype=dtype), 40)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run without TRITON_INTERPRET: the kernels must be JIT functions to compile", file=sys.stderr)
        return 2
    if len(sys.argv) != 2 or sys.argv[1] not in TARGETS:
        print(f"usage: python -m tests.runtime.triton_targets {{{','.join(TARGETS)}}}", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from llmopt.runtime.executor.kernels import triton_sparse24

    capability, shared_limit, fp8 = TARGETS[sys.argv[1]]
    triton_sparse24.shared_per_block = lambda device: shared_limit  # (the wrappers size their pipelines by it)
    launches = record_launches()
    launch_every_kernel()
    seen, failures = set(), 0
    for fn, args, kwargs, fp8_launch in launches:
        if fp8_launch and not fp8:
            continue
        sig, constexprs, options = signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sig.items()), tuple(sorted(constexprs.items(), key=str)), tuple(options.items()))
        if key in seen:
            continue
        seen.add(key)
        row = {"target": sys.argv[1], "kernel": fn.__name__,
               "signature": {k: v for k, v in sig.items() if v != "constexpr"},
               "constexprs": {k: str(v) for k, v in constexprs.items()}, "options": options}
        try:
            compiled = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", capability, 32),
                                      options=options)
            row["shared"] = compiled.metadata.shared
            row["ok"] = compiled.metadata.shared <= shared_limit
            if not row["ok"]:
                row["error"] = f"shared memory {compiled.metadata.shared} > {shared_limit}"
        except Exception as error:  # noqa: BLE001  (a compile error: the kernel would fail on a GPU alike)
            cause = error.__cause__ or error
            row["ok"], row["error"] = False, f"{type(cause).__name__}: {str(cause).strip()[-300:]}"
        failures += not row["ok"]
        print(json.dumps(row), flush=True)
    print(json.dumps({"target": sys.argv[1], "compiled": len(seen), "failed": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
