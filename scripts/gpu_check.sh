#!/usr/bin/env bash
# GPU check (under 8 minutes; the targets table printed last): the Triton kernel tests on CUDA, a short batch-1 decode bench of fp16
# vs int4 (W4A16 Triton) on a random model with SmolLM2-135M's shape (the weights' values do not change
# speed, and the GPU machine has no model files), the 8-bit KV cache's kernels and a long-context bench against
# the fp16 cache, then the low-precision GEMM rates at 4096^3 (llmopt's Triton
# W8A8 int8 / FP8 and FP8 / NVFP4-weight kernels vs torch._int_mm / _scaled_mm), 2:4 sparse linears at 4096 x 4096
# (fp16 and int4, batch 1 and 512, vs dense), decode steps at batch 1 / 16 / 64 with a profile of where a
# batch-1 step's time goes (benchmarks/gpu/gpu_step.py), and the tensor-parallel
# collectives over NCCL with one rank. Prints everything; paste the
# output into docs/results/gpu.md.
#   bash scripts/gpu_check.sh            (needs python with torch+CUDA and triton; installs llmopt --no-deps)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export TRITON_INTERPRET=0 LLMOPT_HOME=${LLMOPT_HOME:-/tmp/llmopt-gpu-home}
# the engine runs where --device says (its default is the CPU); DEVICE=cpu makes a dry run of the CLI steps
DEVICE=${DEVICE:-cuda}
RESULTS=${RESULTS:-/tmp/llmopt-gpu}  # the JSON files of the benches
mkdir -p "$RESULTS"
FAILED=()
# step NAME COMMAND...: runs one check; a failing step is named at the end and the later steps still run
step() {
  local name=$1 start=$SECONDS; shift
  echo "== $name"
  "$@" || { echo "!! FAILED (exit $?): $name"; FAILED+=("$name"); }
  echo "   ($((SECONDS - start)) s)"
}
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# stop at once (device time is scarce) when llmopt cannot import: every step would fail the same way
if ! missing=$($PY -c "import llmopt.cli.main, triton, pytest" 2>&1); then
  echo "llmopt does not import here; install what it names (pydantic, gguf, typing-inspection are often missing):"
  echo "$missing" | tail -3
  exit 1
fi
# pytest-xdist where installed: each shape compiles its own kernels, and the compiles share the CPU cores
PARALLEL=$($PY -c "import xdist" 2>/dev/null && echo "-n 8 -p no:benchmark" || true)
step "kernel tests on CUDA" timeout 240 $PY -m pytest -q -p no:cacheprovider $PARALLEL tests/runtime/test_triton_kernels.py \
  tests/runtime/test_triton_fused.py
MODEL=/tmp/llmopt-gpu/smollm2-shape  # 0.5 GB: kept out of $RESULTS
if [ ! -d "$MODEL" ]; then
  $PY - "$MODEL" <<'PY'
import sys
from llmopt.core.tiny import save_tiny_model
# SmolLM2-135M's config: 30 layers, hidden 576, MLP 1536, 9 heads / 3 KV heads, vocab 49152, tied embeddings
save_tiny_model(sys.argv[1], "llama", seed=0, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                tie_word_embeddings=True, rope_theta=100000.0)
PY
  $PY -m llmopt quantize "$MODEL" --method rtn --bits 4 --group-size 64 -o "$MODEL-w4" --overwrite >/dev/null
fi
step "batch-1 decode: fp16 vs int4 (SmolLM2-135M shape, random weights)" \
  timeout 150 $PY -m llmopt bench "$MODEL" --device "$DEVICE" --dtype float16 --baseline "$MODEL-w4" --num-requests 2 \
  --max-concurrency 1 --input-len 128 --output-len 128 --peak-bandwidth 4800 --peak-flops 989 \
  --json "$RESULTS/bench.json"
step "decode steps at batch 1 / 16 / 64: exact, fused (Triton) and CUDA-graph paths; where a batch-1 step's time goes" \
  timeout 240 $PY benchmarks/gpu/gpu_step.py "$MODEL" "$MODEL-w4" --device "$DEVICE" --steps 10 \
  --json "$RESULTS/gpu_step.json"
step "step graphs: replayed decode steps give the eager steps' tokens (the CPU stand-in's tests, on CUDA here)" \
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/runtime/test_step_graphs.py
step "the capacity planner's prediction for the bench above (SmolLM2 shape, int4 g64, batch 1, 128/128), to compare" \
  $PY -m llmopt plan "$MODEL" --hardware h200 --workload batch1 --schemes int4-g64,fp16 --kv-dtypes fp16 --rows 4
step "8-bit KV cache: the Triton store / decode / prefill tests on CUDA" \
  timeout 120 $PY -m pytest -q -p no:cacheprovider $PARALLEL tests/runtime/test_kv_quant.py -k "triton"
step "8-bit KV cache: 16 x 4,096-token prompts, int8 vs fp16 cache" \
  timeout 150 $PY -m llmopt bench "$MODEL" --device "$DEVICE" --dtype float16 --kv-cache-dtype int8 --baseline "$MODEL" \
  --num-requests 16 --input-len 4096 --output-len 64 --peak-bandwidth 4800 --peak-flops 989 --json "$RESULTS/kv8.json"
step "parallel engines: the NCCL path with one rank (a TP group's all-reduce and gather on CUDA)" \
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/runtime/test_tensor_parallel.py -k nccl
step "low-precision GEMMs at 4096^3: llmopt's Triton kernels vs torch's _int_mm / _scaled_mm" \
  timeout 120 $PY benchmarks/gpu/lowprec_gpu.py --device "$DEVICE" --json "$RESULTS/lowprec_gpu.json"
step "2:4 sparse linears at 4096 x 4096, 1 and 512 rows: fp16 and int4, each vs its dense kind" \
  timeout 120 $PY benchmarks/gpu/sparse_gpu.py --device "$DEVICE" --json "$RESULTS/sparse_gpu.json"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'failed steps (%d):\n' "${#FAILED[@]}"; printf '  %s\n' "${FAILED[@]}"
else
  echo "all steps passed"
fi
echo "== targets (benchmarks/gpu/targets.py)"
$PY benchmarks/gpu/targets.py "$RESULTS" --json "$RESULTS/targets.json"
[ ${#FAILED[@]} -eq 0 ]
