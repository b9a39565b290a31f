// Fused element-wise ops of the decoder layer, the KV store, greedy sampling, and the batch-1 lm_head (CPU).
//
// At decode the tensors are tiny ([B, hidden] with B = 1..64) and each torch op costs ~10-25 us of dispatch,
// allocation and thread start-up whatever its size: the ~12 element-wise ops per layer were ~20% of a batch-64
// bf16 step and more at batch 1. Each function here is one pass in fp32 registers with the same roundings to
// the storage dtype that transformers' modules apply (normalize in fp32 then cast, scale by the weight in the
// storage dtype; silu rounded before the product), and torch.argmax's tie and NaN rules.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "ops.h"
#include "simd.h"
#include "work_queue.h"

namespace llmopt_cpu::fused {  // entry points declared in ops.h, registered in register.cpp

using namespace llmopt_cpu;

// Rows per parallel task: small batches stay on one thread (starting the pool costs more than the work).
inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elements, 1)); }

// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), x in fp32; with `residual`, x = residual + delta first
// (rounded to the dtype and written back to residual, as `h = h + delta` would leave it).
template <typename T>
void rms_norm_rows(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = residual + r * hidden;
      const T* d = delta ? delta + r * hidden : nullptr;
      T* o = out + r * hidden;
      float sum = 0.f;
      int64_t i = 0;
#if defined(LLMOPT_VEC)
      Vec vsum = vzero();
      for (; i + 16 <= hidden; i += 16) {
        Vec v = load16(x + i);
        if (d) {
          v = round_to<T>(v + load16(d + i));
          store16(x + i, v);
        }
        vsum = vfma(v, v, vsum);
      }
      sum = reduce_add(vsum);
#endif
      for (; i < hidden; ++i) {
        float v = to_float(x[i]);
        if (d) {
          x[i] = from_float<T>(v + to_float(d[i]));
          v = to_float(x[i]);
        }
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / hidden + eps);
      i = 0;
#if defined(LLMOPT_VEC)
      const Vec vinv = vset1(inv);
      for (; i + 16 <= hidden; i += 16) store16(o + i, round_to<T>(load16(x + i) * vinv) * load16(weight + i));
#endif
      for (; i < hidden; ++i) o[i] = from_float<T>(to_float(from_float<T>(to_float(x[i]) * inv)) * to_float(weight[i]));
    }
  });
}

// Rotary embedding in place on the first `num_heads` heads of each row of x [rows, >= num_heads * head_dim]
// (q and k of the fused qkv output): x = x * cos + rotate_half(x) * sin, each product and the sum rounded to
// the storage dtype as the three torch ops would. cos, sin [rows, head_dim].
template <typename T>
void rotary_rows(T* x, int64_t row_stride, const T* cos, const T* sin, int64_t rows, int64_t num_heads,
                 int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * head_dim;
      const T* s = sin + r * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* v = x + r * row_stride + h * head_dim;
        int64_t i = 0;
#if defined(LLMOPT_VEC)
        for (; i + 16 <= half; i += 16) {
          const Vec x1 = load16(v + i), x2 = load16(v + half + i);
          const Vec lo = round_to<T>(x1 * load16(c + i)) + round_to<T>((vzero() - x2) * load16(s + i));
          const Vec hi = round_to<T>(x2 * load16(c + half + i)) + round_to<T>(x1 * load16(s + half + i));
          store16(v + i, lo);
          store16(v + half + i, hi);
        }
#endif
        for (; i < half; ++i) {
          const float x1 = to_float(v[i]), x2 = to_float(v[half + i]);
          const float lo = to_float(from_float<T>(x1 * to_float(c[i]))) + to_float(from_float<T>(-x2 * to_float(s[i])));
          const float hi = to_float(from_float<T>(x2 * to_float(c[half + i]))) +
                           to_float(from_float<T>(x1 * to_float(s[half + i])));
          v[i] = from_float<T>(lo);
          v[half + i] = from_float<T>(hi);
        }
      }
    }
  });
}

// gate_up [rows, 2 * inter] -> out [rows, inter] = to_dtype(silu(gate)) * up
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if defined(LLMOPT_VEC)
      for (; i + 16 <= inter; i += 16) {
        const Vec x = load16(g + i);
        store16(o + i, round_to<T>(x / (vset1(1.f) + exp16(vzero() - x))) * load16(u + i));
      }
#endif
      for (; i < inter; ++i) {
        const float x = to_float(g[i]);
        o[i] = from_float<T>(to_float(from_float<T>(x / (1.f + std::exp(-x)))) * to_float(u[i]));
      }
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "a contiguous [rows, hidden] tensor expected");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight [hidden] of the input's dtype expected");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  LLMOPT_DISPATCH(x, [&] {
    rms_norm_rows<scalar_t>(const_cast<scalar_t*>(x.data_ptr<scalar_t>()), nullptr, w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// residual += delta (in place), returns rms_norm(residual)
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(residual, weight);
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type(),
              "delta must match the residual");
  const at::Tensor d = delta.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(residual);
  LLMOPT_DISPATCH(residual, [&] {
    rms_norm_rows<scalar_t>(residual.data_ptr<scalar_t>(), d.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), residual.size(0), residual.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up [rows, 2 * intermediate] expected");
  const at::Tensor gu = gate_up.contiguous();
  at::Tensor out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  LLMOPT_DISPATCH(gu, [&] {
    silu_mul_rows<scalar_t>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gu.size(0), gu.size(1) / 2);
  });
  return out;
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x [rows, columns] with contiguous rows expected");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) % 2 == 0,
              "cos, sin [rows, head_dim] expected");
  TORCH_CHECK(num_heads * cos.size(1) <= x.size(1), "more heads than columns");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "dtypes differ");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  LLMOPT_DISPATCH(x, [&] {
    rotary_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                          x.size(0), num_heads, c.size(1));
  });
}

// Row-wise argmax of logits [rows, vocab] (fp32, bf16 or fp16: compared as their exact fp32 values) -> int64
// [rows]: the first maximal index, NaN counting as the maximum (torch.argmax's rules). Taking bf16 logits as
// they are spares converting [64, 49152] to fp32 each step (~3 ms) when every request is greedy.
template <typename T>
void argmax_rows_impl(const T* p, int64_t rows, int64_t vocab, int64_t* o) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = p + r * vocab;
      float best = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t i = 0;
#if defined(LLMOPT_VEC)
      Vec vbig = vset1(best);
      Mask any_nan = 0;
      for (; i + 16 <= vocab; i += 16) {
        const Vec v = load16(row + i);
        any_nan |= nan_mask(v);
        vbig = vmax(vbig, v);
      }
      best = reduce_max(vbig);
      nan = any_nan != 0;
#endif
      for (; i < vocab; ++i) {
        const float v = to_float(row[i]);
        nan |= std::isnan(v);
        best = std::max(best, v);
      }
      int64_t index = -1, j = 0;
#if defined(LLMOPT_VEC)
      const Vec vbest = vset1(best);
      for (; index < 0 && j + 16 <= vocab; j += 16) {
        const Vec v = load16(row + j);
        const Mask hit = nan ? nan_mask(v) : eq_mask(v, vbest);
        if (hit) index = j + __builtin_ctz(hit);
      }
#endif
      for (; index < 0 && j < vocab; ++j) {
        const float v = to_float(row[j]);
        if (nan ? std::isnan(v) : v == best) index = j;
      }
      o[r] = index;
    }
  });
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "logits [rows, vocab] expected");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab > 0, "empty rows");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  LLMOPT_DISPATCH(x, [&] { argmax_rows_impl<scalar_t>(x.data_ptr<scalar_t>(), rows, vocab, out.data_ptr<int64_t>()); });
  return out;
}


// One token's row into a 16-bit cache slot of another type (fp32 into fp16 / bf16, or one 16-bit type into the
// other through fp32, which holds either exactly), each value rounded to nearest even as torch's .to() does
template <typename TS, typename TC>
inline void narrow_row(char* dst, const char* src, int64_t width) {
  TC* d = reinterpret_cast<TC*>(dst);
  const TS* x = reinterpret_cast<const TS*>(src);
  for (int64_t j = 0; j < width; ++j) d[j] = static_cast<TC>(static_cast<float>(x[j]));
}

// k, v [T, kv_heads, head_dim] (rows may be strided: views into the fused qkv output) -> their cache slots
// (caches [num_blocks, block_size, kv_heads, head_dim], slot = block * block_size + offset): one call instead
// of two index_put.
void store_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "contiguous caches of one shape expected");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) * k.size(2) == k_cache.size(2) * k_cache.size(3),
              "k, v [T, kv_heads, head_dim] expected");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "each token's k and v must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k and v must share a dtype, and so must the caches");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0), "one slot per token");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  // the same dtype: a copy per row; fp32 into a 16-bit cache: a rounding per value
  using RowStore = void (*)(char*, const char*, int64_t);
  RowStore narrow = nullptr;
  if (k.scalar_type() != k_cache.scalar_type()) {
    const auto src = k.scalar_type(), dst = k_cache.scalar_type();
    TORCH_CHECK((src == at::kFloat || src == at::kHalf || src == at::kBFloat16) &&
                    (dst == at::kHalf || dst == at::kBFloat16),
                "k, v must have the cache's dtype (or be fp32 / fp16 / bf16 for fp16 / bf16 caches)");
    if (src == at::kFloat) {
      narrow = dst == at::kHalf ? narrow_row<float, at::Half> : narrow_row<float, at::BFloat16>;
    } else {
      narrow = dst == at::kHalf ? narrow_row<at::BFloat16, at::Half> : narrow_row<at::Half, at::BFloat16>;
    }
  }
  const int64_t width = k.size(1) * k.size(2), row_bytes = width * k_cache.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < k.size(0); ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot outside the cache");
    if (narrow != nullptr) {
      narrow(kc + sp[t] * row_bytes, kp + t * k_stride, width);
      narrow(vc + sp[t] * row_bytes, vp + t * v_stride, width);
    } else {
      std::memcpy(kc + sp[t] * row_bytes, kp + t * k_stride, row_bytes);
      std::memcpy(vc + sp[t] * row_bytes, vp + t * v_stride, row_bytes);
    }
  }
}

constexpr int64_t GEMV_MAX_ROWS = 8;  // x rows one pass of gemv serves (cpu_ops.GEMV_MAX_ROWS); more go 8 at a time
// Weight rows one x row meets at a time in gemv_rows; with more than one, the rows 2 x that many ahead are also
// requested early. Chosen per CPU when the kernels are built (cpu_ops.gemv_row_streams): 4 on Intel AVX-512, 1 on
// AMD and on AVX2 builds.
#ifndef LLMOPT_GEMV_STREAMS
#define LLMOPT_GEMV_STREAMS 1
#endif
constexpr int GEMV_ROW_STREAMS = LLMOPT_GEMV_STREAMS;
static_assert(GEMV_ROW_STREAMS == 1 || GEMV_ROW_STREAMS == 2 || GEMV_ROW_STREAMS == 4, "1, 2 or 4 row streams");
// Weight rows the AVX2 build takes at a time against two input rows (cpu_ops.gemv_pair_streams): 2 on Intel, 1 on
// AMD (one sequential stream, as for one input row).
#ifndef LLMOPT_GEMV_PAIR_STREAMS
#define LLMOPT_GEMV_PAIR_STREAMS 2
#endif
constexpr int GEMV_PAIR_STREAMS = LLMOPT_GEMV_PAIR_STREAMS;
static_assert(GEMV_PAIR_STREAMS == 1 || GEMV_PAIR_STREAMS == 2, "1 or 2 row streams at two inputs");

#if defined(LLMOPT_VEC)
// The R weight rows after the next R (rows [K] from `row`), requested early: the group a loop taking R rows at a
// time reads two groups from now
template <int R, typename TW>
inline void request_rows_ahead(const TW* row, int64_t K) {
  for (int64_t off = 0; off < R * K * static_cast<int64_t>(sizeof(TW)); off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + 2 * R * K) + off, _MM_HINT_T0);
}
#endif

#if defined(LLMOPT_VEC)
// R weight rows from `row` against M inputs: y[m * N + r] (yp at the first row's column), one accumulation chain
// per weight row and input, the same chain at any R and M: so an input's outputs are the same bits whether it is
// alone (gemv_rows) or with others (gemm_few_rows), and whichever rows a thread's range starts or ends with. With
// AVX512_BF16 and both in bf16 the products come straight from the stored pairs (vdpbf16ps); else 16-wide FMAs.
// A column remainder is added in plain order after the vector sum.
template <typename TX, typename TW, int M, int R>
inline void vec_rows(const TX* xp, const TW* row, TX* yp, int64_t K, int64_t N) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<TX, at::BFloat16> && std::is_same_v<TW, at::BFloat16>) {
    const int64_t vec_k = K - K % 32;
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < vec_k; k += 32) {
      __m512bh w[R];
      for (int r = 0; r < R; ++r) w[r] = (__m512bh)_mm512_loadu_si512(row + r * K + k);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xp + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w[r], xv);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        float sum = _mm512_reduce_add_ps(acc[r][m]);
        for (int64_t k = vec_k; k < K; ++k) sum += to_float(row[r * K + k]) * to_float(xp[m * K + k]);
        yp[m * N + r] = from_float<TX>(sum);
      }
    return;
  }
#endif
  const int64_t vec_k = K - K % 16;
  Vec acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  for (int64_t k = 0; k < vec_k; k += 16) {
    Vec w[R];
    for (int r = 0; r < R; ++r) w[r] = load16(row + r * K + k);
    for (int m = 0; m < M; ++m) {
      const Vec xv = load16(xp + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = vfma(w[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float sum = reduce_add(acc[r][m]);
      for (int64_t k = vec_k; k < K; ++k) sum += to_float(row[r * K + k]) * to_float(xp[m * K + k]);
      yp[m * N + r] = from_float<TX>(sum);
    }
}
#endif

// Without vectors: each output in plain order.
template <typename TX, typename TW>
void scalar_rows(int64_t rows, const TX* xp, const TW* wp, TX* yp, int64_t K, int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n)
    for (int64_t m = 0; m < rows; ++m) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += to_float(wp[n * K + k]) * to_float(xp[m * K + k]);
      yp[m * N + n] = from_float<TX>(sum);
    }
}

// y [1, N] = x [1, K] @ weight [N, K]^T for one row, fp32 accumulation, in x's dtype (batch-1 decode's lm_head:
// 49152 x 576 for SmolLM2, read once per token, usually from memory). The weight may be stored narrower than x
// (an fp32 model whose lm_head holds exactly fp16 or bf16 values, as an artifact's does: half the bytes, the
// same result). Row streams, measured with the weights from memory (2 cores): on a Xeon (AVX-512) 4 rows at a
// time (4 independent accumulation chains and 4 memory streams) with the rows 8 ahead requested early; on AMD
// CPUs one row at a time, a single sequential stream the hardware prefetcher follows alone. AVX2 EPYC (Zen 3):
// 49152 x 576 fp16 4 streams with the requests ~23 GB/s, without them ~18, one stream ~25 (a plain read ~27); a
// token's fp32 layers one stream 10-20% faster. AVX-512 EPYC (Zen 4), 4 streams with the requests -> one stream:
// a token's 30 fp32 layers 20.4-22.8 -> 15.1-19.5 ms, the head 49152 x 576 fp16 2.0-3.6 -> 1.3-2.0 ms, bf16 1.6-2.4
// -> 1.3-1.9 ms (4 streams without the requests and 2 streams were slower still). Each row's sum is the same Vec
// chain either way: the same bits. With AVX512_BF16 and both in bf16 the products come straight from the stored
// pairs (vdpbf16ps): ~15% more bandwidth than oneDNN's linear reaches on it.
template <typename TX, typename TW>
void gemv_rows(const TX* xp, const TW* wp, TX* yp, int64_t K, int64_t begin, int64_t end) {
#if defined(LLMOPT_VEC)
  int64_t n = begin;
  for (; n + GEMV_ROW_STREAMS <= end; n += GEMV_ROW_STREAMS) {
    if constexpr (GEMV_ROW_STREAMS > 1) request_rows_ahead<GEMV_ROW_STREAMS>(wp + n * K, K);
    vec_rows<TX, TW, 1, GEMV_ROW_STREAMS>(xp, wp + n * K, yp + n, K, 0);
  }
  for (; n < end; ++n) vec_rows<TX, TW, 1, 1>(xp, wp + n * K, yp + n, K, 0);
#else
  scalar_rows<TX, TW>(1, xp, wp, yp, K, 0, begin, end);
#endif
}

// M (2..8) inputs against weight rows n in [begin, end): each weight row is streamed once for all M inputs (an
// sgemm at M = 6 packs the weight first and runs at half the speed of M = 1: speculative verification's shape).
// y [M, N] = x [M, K] . w [N, K]^T; R weight rows at a time, each x vector loaded once per R rows. R x M fp32
// accumulators must stay in registers: AVX-512 (32 registers, one per Vec): R = 4 up to M = 6, else 2; AVX2 (16
// registers, two per Vec): R = GEMV_PAIR_STREAMS for M = 2, else 1 (R = 4 at M = 6 spilled 48 registers' worth),
// and at M = 7, 8 one half of each Vec at a time (gemm_few_rows_halves).
#if defined(LLMOPT_VEC) && !defined(__AVX512F__)
// 8 lanes of a 16-column step: the low or the high half of a Vec load
inline __m256 load8_half(const float* p, int half) { return _mm256_loadu_ps(p + 8 * half); }
inline __m256 load8_half(const at::Half* p, int half) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * half)));
}
inline __m256 load8_half(const at::BFloat16* p, int half) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * half));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// AVX2 at 7 or 8 inputs: one weight row, the Vec accumulators' low lanes for all M inputs in one pass over the row
// and their high lanes in a second (the row then in L1): M + 2 registers a pass, where both halves at once need 2M
// + 2 (18 at M = 8: spilled). Each lane sums the same products in the same order as gemv_rows' Vec, so each
// input's outputs are the same bits at any M.
template <typename TX, typename TW, int M>
void gemm_few_rows_halves(const TX* xp, const TW* wp, TX* yp, int64_t K, int64_t N, int64_t begin, int64_t end) {
  const int64_t vec_k = K - K % 16;
  for (int64_t n = begin; n < end; ++n) {
    const TW* row = wp + n * K;
    for (int64_t off = 0; off < K * static_cast<int64_t>(sizeof(TW)); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + 4 * K) + off, _MM_HINT_T0);
    __m256 acc[2][M];
    for (int half = 0; half < 2; ++half) {
      for (int m = 0; m < M; ++m) acc[half][m] = _mm256_setzero_ps();
      for (int64_t k = 0; k < vec_k; k += 16) {
        const __m256 w = load8_half(row + k, half);
        for (int m = 0; m < M; ++m) acc[half][m] = _mm256_fmadd_ps(w, load8_half(xp + m * K + k, half), acc[half][m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      float sum = reduce_add(Vec{acc[0][m], acc[1][m]});
      for (int64_t k = vec_k; k < K; ++k) sum += to_float(row[k]) * to_float(xp[m * K + k]);
      yp[m * N + n] = from_float<TX>(sum);
    }
  }
}
#endif

template <typename TX, typename TW, int M>
void gemm_few_rows(const TX* xp, const TW* wp, TX* yp, int64_t K, int64_t N, int64_t begin, int64_t end) {
#if defined(LLMOPT_VEC) && !defined(__AVX512F__)
  // (at 3-6 inputs both halves fit: one pass is faster; at 8 the halves' passes took 20% less time than one
  // spilled pass over 49152 x 576 fp16 weights from memory)
  if constexpr (M >= 7) return gemm_few_rows_halves<TX, TW, M>(xp, wp, yp, K, N, begin, end);
#endif
#if defined(__AVX512F__)
  constexpr int R = M <= 6 ? 4 : 2;
#else
  constexpr int R = M <= 2 ? GEMV_PAIR_STREAMS : 1;
#endif
#if defined(LLMOPT_VEC)
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    request_rows_ahead<R>(wp + n * K, K);
    vec_rows<TX, TW, M, R>(xp, wp + n * K, yp + n, K, N);
  }
  for (; n < end; ++n) vec_rows<TX, TW, M, 1>(xp, wp + n * K, yp + n, K, N);
#else
  scalar_rows<TX, TW>(M, xp, wp, yp, K, N, begin, end);
#endif
}

// rows (1..8) inputs from xp against weight rows [begin, end), into yp [rows, N]
template <typename TX, typename TW>
void few_rows(int64_t rows, const TX* xp, const TW* wp, TX* yp, int64_t K, int64_t N, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: return gemv_rows<TX, TW>(xp, wp, yp, K, begin, end);
    case 2: return gemm_few_rows<TX, TW, 2>(xp, wp, yp, K, N, begin, end);
    case 3: return gemm_few_rows<TX, TW, 3>(xp, wp, yp, K, N, begin, end);
    case 4: return gemm_few_rows<TX, TW, 4>(xp, wp, yp, K, N, begin, end);
    case 5: return gemm_few_rows<TX, TW, 5>(xp, wp, yp, K, N, begin, end);
    case 6: return gemm_few_rows<TX, TW, 6>(xp, wp, yp, K, N, begin, end);
    case 7: return gemm_few_rows<TX, TW, 7>(xp, wp, yp, K, N, begin, end);
    default: return gemm_few_rows<TX, TW, 8>(xp, wp, yp, K, N, begin, end);
  }
}

// More than 8 inputs (the lm_head of a decode step of many sequences): blocks of weight rows that stay in L2, each
// multiplied by all inputs 8 at a time, so the weight is read from memory once. Blocks start at multiples of 64
// rows from the thread's range, so each input's outputs are the same bits as through 1-8 rows. (An fp32 model's
// lm_head through BLAS multiplies its fp32 copy, twice the bytes: 49152 x 576 at 16 rows 27.6 ms against 9.7 here
// on the 16-bit weight, 2-core EPYC.)
template <typename TX, typename TW>
void gemv_many_impl(const TX* xp, const TW* wp, TX* yp, int64_t M, int64_t K, int64_t N) {
  const int64_t block = std::max<int64_t>(64, (256 << 10) / (K * static_cast<int64_t>(sizeof(TW))) / 64 * 64);
  parallel_chunks(N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += block) {
      const int64_t n1 = std::min(end, n0 + block);
      for (int64_t m = 0; m < M; m += GEMV_MAX_ROWS)
        few_rows<TX, TW>(std::min(GEMV_MAX_ROWS, M - m), xp + m * K, wp, yp + m * N, K, N, n0, n1);
    }
  });
}

template <typename TX, typename TW>
void gemv_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const TX* xp = x.data_ptr<TX>();
  const TW* wp = w.data_ptr<TW>();
  TX* yp = y.data_ptr<TX>();
  if (M > GEMV_MAX_ROWS) return gemv_many_impl<TX, TW>(xp, wp, yp, M, K, N);
  parallel_chunks(N, 64, [&](int64_t begin, int64_t end) { few_rows<TX, TW>(M, xp, wp, yp, K, N, begin, end); });
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && weight.dim() == 2 && weight.size(1) == x.size(1),
              "x [M, K] and weight [N, K] expected");
  const bool narrower = x.scalar_type() == at::kFloat &&
                        (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf);
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() || narrower,
              "weight must have x's dtype (or bf16 / fp16 with fp32 x)");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  if (weight.scalar_type() == at::kBFloat16 && narrower) {
    gemv_impl<float, at::BFloat16>(xc, wc, y);
  } else if (weight.scalar_type() == at::kHalf && narrower) {
    gemv_impl<float, at::Half>(xc, wc, y);
  } else {
    LLMOPT_DISPATCH(xc, [&] { gemv_impl<scalar_t, scalar_t>(xc, wc, y); });
  }
  return y;
}

}  // namespace llmopt_cpu::fused
