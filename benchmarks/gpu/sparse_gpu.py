"""2:4 sparse linears on a CUDA GPU against dense, at N x K (default 4096 x 4096) and 1 and 512 rows: fp16 dense
(`torch.nn.functional.linear`) vs llmopt's `sparse24-cuda` method (the Triton kernel on the compressed values at
<= 16 rows, the sparse tensor cores through torch's semi-structured tensors above), and GPTQ-layout int4 (the
W4A16 Triton kernel) vs 2:4 + int4 (`sparse24-int4-triton`). Each is warmed up, then timed with CUDA events
(median of --repeats); ratios are against the dense row of the same kind at the same rows.

    python benchmarks/gpu/sparse_gpu.py --json /tmp/sparse_gpu.json
    TRITON_INTERPRET=1 python benchmarks/gpu/sparse_gpu.py --device cpu --size 64 128 --rows 1 16   (a dry run, no GPU)
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from lowprec_gpu import timed

from llmopt.compress.masks import nm_mask
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.core.contract import QuantScheme
from llmopt.core.contract.sparse24 import Sparse24Weight, pack_mask
from llmopt.runtime.executor.linear.triton_sparse24 import TritonSparse24Int4Linear, TritonSparse24Linear
from llmopt.runtime.executor.linear.triton_w4a16 import TritonW4A16Linear
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402


def linears(n: int, k: int, device: str) -> dict[str, tuple[str, object]]:
    """{name: (baseline name, module)} for a random 2:4 weight: fp16 dense and sparse, int4 dense and 2:4 + int4."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(n, k, generator=g) * 0.05
    keep = ~nm_mask(dense.abs(), 2, 4)  # [N, K] bool: the two largest of every 4 kept
    pruned = dense * keep
    weight = Sparse24Weight.from_dense(pruned)
    codes = quantize_rtn(pruned, QuantScheme(4, 128, True))
    sparse_codes = quantize_rtn(pruned, QuantScheme(4, 128, True))
    sparse_codes.keep = pack_mask(keep)
    fp16 = pruned.to(device, torch.float16)
    return {
        "fp16 dense F.linear": ("fp16 dense F.linear", lambda x: F.linear(x, fp16)),
        "fp16 2:4 sparse24-cuda": ("fp16 dense F.linear", TritonSparse24Linear(weight, torch.float16, device)),
        "int4 g128 w4a16-triton": ("int4 g128 w4a16-triton", TritonW4A16Linear(codes, torch.float16, device)),
        "int4 g128 2:4 sparse24-int4-triton": ("int4 g128 w4a16-triton",
                                               TritonSparse24Int4Linear(sparse_codes, torch.float16, device)),
    }


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("--size", type=int, nargs=2, default=[4096, 4096], metavar=("N", "K"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 512])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    n, k = args.size
    cases = linears(n, k, args.device)
    rows = []
    print(f"{'linear':<36} {'rows':>5} {'ms':>9} {'vs dense':>9}")
    for m in args.rows:
        x = torch.randn(m, k, device=args.device, dtype=torch.float16)
        times = {}
        for name, (baseline, fn) in cases.items():
            with torch.no_grad():
                times[name] = seconds = timed(lambda fn=fn, x=x: fn(x), args.repeats, args.device)
            ratio = seconds / times[baseline]
            print(f"{name:<36} {m:>5} {seconds * 1e3:>9.4f} {ratio:>8.2f}x")
            rows.append({"linear": name, "rows": m, "ms": seconds * 1e3, "vs_dense": ratio})
    if args.json:
        with open(args.json, "w") as f:
            gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
            json.dump({"size": [n, k], "gpu": gpu, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
