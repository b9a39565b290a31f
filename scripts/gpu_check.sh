#!/usr/bin/env bash
# GPU check (under 5 minutes): the Triton kernel tests on CUDA, a short batch-1 decode bench of fp16
# vs int4 (W4A16 Triton) on a random model with SmolLM2-135M's shape (the weights' values do not change
# speed, and the GPU machine has no model files), the 8-bit KV cache's kernels and a long-context bench against
# the fp16 cache, then the low-precision GEMM rates at 4096^3 (llmopt's Triton
# W8A8 int8 / FP8 and FP8 / NVFP4-weight kernels vs torch._int_mm / _scaled_mm), 2:4 sparse linears at 4096 x 4096
# (fp16 and int4, batch 1 and 512, vs dense), and the tensor-parallel
# collectives over NCCL with one rank. Prints everything; paste the
# output into docs/results/gpu.md.
#   bash scripts/gpu_check.sh            (needs python with torch+CUDA and triton; installs llmopt --no-deps)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export TRITON_INTERPRET=0 LLMOPT_HOME=${LLMOPT_HOME:-/tmp/llmopt-gpu-home}
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
echo "== kernel tests on CUDA"
timeout 180 $PY -m pytest -q -p no:cacheprovider tests/runtime/test_triton_kernels.py
echo "== batch-1 decode: fp16 vs int4 (SmolLM2-135M shape, random weights)"
MODEL=/tmp/llmopt-gpu/smollm2-shape
if [ ! -d "$MODEL" ]; then
  $PY - "$MODEL" <<'PY'
import sys
from llmopt.core.tiny import save_tiny_model
# SmolLM2-135M's config: 30 layers, hidden 576, MLP 1536, 9 heads / 3 KV heads, vocab 49152, tied embeddings
save_tiny_model(sys.argv[1], "llama", seed=0, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                tie_word_embeddings=True, rope_theta=100000.0)
PY
  $PY -m llmopt quantize "$MODEL" --method rtn --bits 4 --group-size 64 -o "$MODEL-w4" --overwrite
fi
timeout 150 $PY -m llmopt bench "$MODEL" --dtype float16 --baseline "$MODEL-w4" --num-requests 4 \
  --max-concurrency 1 --input-len 128 --output-len 128 --peak-bandwidth 4800 --peak-flops 989 \
  --json /tmp/llmopt-gpu/bench.json
echo "== the capacity planner's prediction for the bench above (SmolLM2 shape, int4 g64, batch 1, 128/128), to compare"
$PY -m llmopt plan "$MODEL" --hardware h200 --workload batch1 --schemes int4-g64,fp16 --kv-dtypes fp16 --rows 4 \
  || true
echo "== 8-bit KV cache: the Triton store / decode / prefill tests on CUDA, then 16 x 4,096-token prompts, int8 vs fp16 cache"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/runtime/test_kv_quant.py -k "triton"
timeout 150 $PY -m llmopt bench "$MODEL" --dtype float16 --kv-cache-dtype int8 --baseline "$MODEL" --num-requests 16 \
  --input-len 4096 --output-len 64 --peak-bandwidth 4800 --peak-flops 989 --json /tmp/llmopt-gpu/kv8.json
echo "== parallel engines: the NCCL path with one rank (a TP group's all-reduce and gather on CUDA)"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/runtime/test_tensor_parallel.py -k nccl
echo "== low-precision GEMMs at 4096^3: llmopt's Triton kernels vs torch's _int_mm / _scaled_mm"
timeout 120 $PY benchmarks/lowprec_gpu.py --json /tmp/llmopt-gpu/lowprec_gpu.json
echo "== 2:4 sparse linears at 4096 x 4096, 1 and 512 rows: fp16 and int4, each vs its dense kind"
timeout 120 $PY benchmarks/sparse_gpu.py --json /tmp/llmopt-gpu/sparse_gpu.json
