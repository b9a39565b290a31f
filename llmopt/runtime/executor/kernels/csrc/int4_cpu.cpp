// int4 weights dequantized whole into a dense matrix (bf16, fp16 or fp32), for the dense GEMM that then runs on
// the CPU's matrix or FMA units: at 16+ rows (prefill chunks, large decode batches) that beats aten's int4 kernel, whose cost
// grows linearly with the rows. The torch expression of the same arithmetic (quant_matmul.int4_dequantize) takes
// 1.5-3 ms per SmolLM2 linear; this one pass takes ~0.1-0.3 ms.
//
// nibbles [N, K/2] uint8 (column 2j in the low nibble of byte j, 2j+1 in the high one: quant_matmul.pack_nibbles),
// scales_and_offsets [K/group, N, 2] with w = (q - 8) * scale + offset per group (aten's int4 convention), written
// into out [N, K] (the dtype of scales_and_offsets) as fma(q - 8, scale, offset) in fp32, rounded once: in bf16
// the same bits as the torch expression. For few rows, int4_matmul_rows multiplies straight from the codes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "tiled_gemm.h"

namespace llmopt_cpu::int4 {  // entry points declared in ops.h, registered in register.cpp

using namespace llmopt_cpu;

// W's rows begin..end into out [end - begin, K]
template <typename T>
void dequantize_rows(const uint8_t* nibbles, const T* so, T* out, int64_t N, int64_t K, int64_t group,
                     int64_t begin, int64_t end) {
  const int64_t groups = K / group;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = nibbles + n * (K / 2);
    T* o = out + (n - begin) * K;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = static_cast<float>(so[(g * N + n) * 2]);
      const float offset = static_cast<float>(so[(g * N + n) * 2 + 1]);
      int64_t k = g * group;
#if defined(LLMOPT_VEC)
      {
        const Vec vs = vset1(scale), vo = vset1(offset), eight = vset1(8.f);
        const __m128i low = _mm_set1_epi8(0x0F);
        for (; k + 32 <= (g + 1) * group; k += 32) {  // 16 bytes -> 32 codes in column order
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
          const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
          // codes 0-15 and 16-31, each w = fma(q - 8, scale, offset) rounded once to T
          store16(o + k, vfma(from_bytes(_mm_unpacklo_epi8(lo, hi)) - eight, vs, vo));
          store16(o + k + 16, vfma(from_bytes(_mm_unpackhi_epi8(lo, hi)) - eight, vs, vo));
        }
      }
#endif
      for (; k < (g + 1) * group; ++k) {
        const int code = (row[k / 2] >> ((k % 2) * 4)) & 0xF;
        o[k] = static_cast<T>(std::fma(static_cast<float>(code - 8), scale, offset));
      }
    }
  }
}

// y [M, N] = x [M, K] @ dequant(W)^T for few rows (decode at small batches), reading the 4-bit codes once per
// call: w = (q - 8) * scale + offset per group, so per output and group
//   y += scale * sum_k x_k q_k + (offset - 8 * scale) * sum_k x_k,
// with sum_k x_k per (row, group) computed once. Byte j holds columns 2j (low nibble) and 2j + 1 (high), so x is
// split once into its even and odd columns (xe, xo: fp32 [M, K/2]) and 16 bytes are widened once into 16 low
// and 16 high codes, each multiplied with 16 contiguous inputs: no shuffles. NB outputs at a time with two
// accumulators each keep 2 NB independent FMA chains (one chain was latency-bound). aten's int4 kernel serves
// bf16 activations well, but with fp32 activations it ran ~20x slower than this on SmolLM2's shapes (137 vs ~13
// ms per token at batch 1).
template <typename T, int MB, int NB>
inline void int4_outputs(const float* xe, const float* xo, int64_t x_stride, const float* xsum, const uint8_t* nibbles,
                         const T* so, float* y, int64_t y_stride, int64_t N, int64_t K, int64_t group, int64_t n) {
  const int64_t groups = K / group, half = group / 2;
  float out[MB][NB] = {};
#if defined(LLMOPT_VEC)
  Vec total[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) total[m][j] = vzero();
#endif
  for (int64_t g = 0; g < groups; ++g) {
    int64_t b = g * half;  // byte offset in the row (= column pair index)
#if defined(LLMOPT_VEC)
    Vec acc0[MB][NB], acc1[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) acc0[m][j] = acc1[m][j] = vzero();
    for (; b + 16 <= (g + 1) * half; b += 16) {
      Vec lo[NB], hi[NB];
      for (int j = 0; j < NB; ++j) nibbles16(nibbles + (n + j) * (K / 2) + b, lo[j], hi[j]);
      for (int m = 0; m < MB; ++m) {
        const Vec e = load16(xe + m * x_stride + b), o = load16(xo + m * x_stride + b);
        for (int j = 0; j < NB; ++j) {
          acc0[m][j] = vfma(e, lo[j], acc0[m][j]);
          acc1[m][j] = vfma(o, hi[j], acc1[m][j]);
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const Vec vs = vset1(to_float(so[(g * N + n + j) * 2]));
      for (int m = 0; m < MB; ++m) total[m][j] = vfma(vs, acc0[m][j] + acc1[m][j], total[m][j]);
    }
#endif
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) {
        const uint8_t* row = nibbles + (n + j) * (K / 2);
        float dot = 0.f;
        for (int64_t bb = b; bb < (g + 1) * half; ++bb)
          dot += xe[m * x_stride + bb] * static_cast<float>(row[bb] & 0xF) +
                 xo[m * x_stride + bb] * static_cast<float>(row[bb] >> 4);
        const float scale = to_float(so[(g * N + n + j) * 2]), offset = to_float(so[(g * N + n + j) * 2 + 1]);
        out[m][j] += scale * dot + (offset - 8.f * scale) * xsum[m * groups + g];
      }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
#if defined(LLMOPT_VEC)
      out[m][j] += reduce_add(total[m][j]);
#endif
      y[m * y_stride + n + j] = out[m][j];
    }
}

template <typename T, int MB>
void int4_rows_block(const float* xe, const float* xo, int64_t x_stride, const float* xsum, const uint8_t* nibbles,
                     const T* so, float* y, int64_t y_stride, int64_t N, int64_t K, int64_t group, int64_t n_begin,
                     int64_t n_end) {
  int64_t n = n_begin;
  if constexpr (MB == 1)  // one row: 4 outputs at a time (8 chains); two rows: 2 (AVX2 has 16 registers)
    for (; n + 4 <= n_end; n += 4) int4_outputs<T, MB, 4>(xe, xo, x_stride, xsum, nibbles, so, y, y_stride, N, K, group, n);
  for (; n + 2 <= n_end; n += 2) int4_outputs<T, MB, 2>(xe, xo, x_stride, xsum, nibbles, so, y, y_stride, N, K, group, n);
  for (; n < n_end; ++n) int4_outputs<T, MB, 1>(xe, xo, x_stride, xsum, nibbles, so, y, y_stride, N, K, group, n);
}

// Both few-row products accumulate in fp32 [M, N]; y gets it in its own dtype.
template <typename T>
void write_rows(const std::vector<float>& out, at::Tensor& y) {
  T* yp = y.data_ptr<T>();
  for (size_t i = 0; i < out.size(); ++i) yp[i] = from_float<T>(out[i]);
}

template <typename T>
void int4_rows_impl(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& so, int64_t group, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = nibbles.size(0), groups = K / group, half = K / 2;
  const T* xp = x.data_ptr<T>();
  const T* sp = so.data_ptr<T>();
  // once per call: the inputs' even and odd columns and their sum per group, fp32
  std::vector<float> xe(M * half), xo(M * half), xsum(M * groups, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < half; ++j) {
      xe[m * half + j] = to_float(xp[m * K + 2 * j]);
      xo[m * half + j] = to_float(xp[m * K + 2 * j + 1]);
      xsum[m * groups + 2 * j / group] += xe[m * half + j] + xo[m * half + j];
    }
  const uint8_t* np = nibbles.data_ptr<uint8_t>();
  std::vector<float> out(M * N);
  float* yp = out.data();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += 2) {  // rows in pairs: each pair widens the codes once
      const float *e = xe.data() + m0 * half, *o = xo.data() + m0 * half, *s = xsum.data() + m0 * groups;
      if (M - m0 >= 2) int4_rows_block<T, 2>(e, o, half, s, np, sp, yp + m0 * N, N, N, K, group, begin, end);
      else int4_rows_block<T, 1>(e, o, half, s, np, sp, yp + m0 * N, N, N, K, group, begin, end);
    }
  });
  write_rows<T>(out, y);
}

// y [M, N] = x [M, K] @ dequant(W)^T from the codes repacked at load into panels of 16 outputs
// (quant_matmul.pack_int4_panels): panel p holds, for each column k, the 16 codes of outputs 16p..16p+15 in 8
// bytes (output i in the low nibble of byte i, output 8 + i in the high one), and per group one fp32 vector of
// the 16 scales and one of the 16 biases (offset - 8 scale). Each column's 16 weights are decoded once into one
// vector, w = q * scale + bias, and multiplied by every row's input broadcast: PR rows of accumulators, each a
// vector of 16 outputs, held over the whole of K (no horizontal sums, no buffer). The weight's decoding is paid
// once per PR rows, the multiply-adds run at the FMA units' rate, as in a GEMM micro-kernel on a prepacked matrix.
// (A variant that dequantized 4 outputs at a time into L1 and reduced 4 x 4 dot products was 1.1-1.5x slower at
// 2-64 rows.)
#if defined(__AVX512F__)
constexpr int PR = 16;  // 16 accumulators + the weight, scale, bias and input vectors of 32 registers
#else
constexpr int PR = 6;  // AVX2: 6 two-register accumulators, the weight, the input; scale and bias from L1
#endif

#if defined(LLMOPT_VEC)
// 8 bytes of one column -> its 16 codes as floats in output order
inline Vec panel_codes(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  return from_bytes(_mm_unpacklo_epi64(_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low)));
}
#endif

template <int MB>
void panel_rows(const float* x, int64_t K, const uint8_t* codes, const float* sb, int64_t group, float* y, int64_t N,
                int64_t n0) {
  const int64_t groups = K / group;
#if defined(LLMOPT_VEC)
  Vec acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const Vec scale = load16(sb + g * 32), bias = load16(sb + g * 32 + 16);
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      const Vec w = vfma(panel_codes(codes + k * 8), scale, bias);
      for (int m = 0; m < MB; ++m) acc[m] = vfma(vset1(x[m * K + k]), w, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) store16(y + m * N + n0, acc[m]);
#else
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < 16; ++i) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t byte = codes[k * 8 + i % 8];
        const float q = static_cast<float>(i < 8 ? byte & 0xF : byte >> 4);
        const float* s = sb + (k / group) * 32;
        sum += x[m * K + k] * std::fma(q, s[i], s[16 + i]);
      }
      y[m * N + n0 + i] = sum;
    }
#endif
}

template <typename T>
void int4_panels_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sb, int64_t group,
                      at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0) * 16;
  std::vector<float> xf;  // the inputs in fp32, once per call
  const float* xp;
  if constexpr (std::is_same_v<T, float>) {
    xp = x.data_ptr<float>();
  } else {
    xf.resize(M * K);
    const T* src = x.data_ptr<T>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(src[i]);
    xp = xf.data();
  }
  std::vector<float> out;
  float* yp;
  if constexpr (std::is_same_v<T, float>) {
    yp = y.data_ptr<float>();
  } else {
    out.resize(M * N);
    yp = out.data();
  }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = sb.data_ptr<float>();
  const int64_t groups = K / group;
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      row_chunks<PR>(M, [&](auto rows, int64_t m) {
        panel_rows<decltype(rows)::value>(xp + m * K, K, cp + p * K * 8, sp + p * groups * 32, group, yp + m * N, N,
                                          p * 16);
      });
  });
  if constexpr (!std::is_same_v<T, float>) write_rows<T>(out, y);
}

at::Tensor int4_matmul_panels(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_biases,
                              int64_t group) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 8 && codes.scalar_type() == at::kByte,
              "panel codes [N/16, K, 8] uint8 expected");
  const int64_t panels = codes.size(0), K = codes.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [M, K] expected, K matching the codes");
  TORCH_CHECK(group > 0 && K % group == 0, "the group size must divide K");
  TORCH_CHECK(scales_biases.dim() == 4 && scales_biases.size(0) == panels && scales_biases.size(1) == K / group &&
                  scales_biases.size(2) == 2 && scales_biases.size(3) == 16 &&
                  scales_biases.scalar_type() == at::kFloat,
              "panel scales and biases [N/16, K/group, 2, 16] fp32 expected");
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scales_biases.contiguous();
  at::Tensor y = at::empty({x.size(0), panels * 16}, x.options());
  LLMOPT_DISPATCH(xc, [&] { int4_panels_impl<scalar_t>(xc, cc, sc, group, y); });
  return y;
}

// The checks and dtype dispatch of the few-row and tiled products: x [M, K] -> y [M, N] in x's dtype.
template <template <typename> class Impl>
at::Tensor int4_rows_op(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales_and_offsets,
                        int64_t group, int64_t tile_bytes = 0) {
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kByte, "nibbles [N, K/2] uint8 expected");
  const int64_t N = nibbles.size(0), K = nibbles.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [M, K] expected, K matching the codes");
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "the group size must be even and divide K");
  TORCH_CHECK(scales_and_offsets.dim() == 3 && scales_and_offsets.size(0) == K / group &&
                  scales_and_offsets.size(1) == N && scales_and_offsets.size(2) == 2,
              "scales_and_offsets [K/group, N, 2] expected");
  TORCH_CHECK(x.scalar_type() == scales_and_offsets.scalar_type(), "x must have the scales' dtype");
  const at::Tensor xc = x.contiguous(), nib = nibbles.contiguous(), so = scales_and_offsets.contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  LLMOPT_DISPATCH(xc, [&] { Impl<scalar_t>::run(xc, nib, so, group, y, tile_bytes); });
  return y;
}

template <typename T>
struct WidenedCodes {
  static void run(const at::Tensor& x, const at::Tensor& n, const at::Tensor& so, int64_t g, at::Tensor& y,
                  int64_t) {
    int4_rows_impl<T>(x, n, so, g, y);
  }
};
// x [M, K] @ dequant(W)^T at batched row counts (tiled_gemm.h): the weight dequantized tile by tile, each tile
// multiplied by all rows while it is in L2.
template <typename T>
struct DequantizedTiles {
  static void run(const at::Tensor& x, const at::Tensor& n, const at::Tensor& so, int64_t g, at::Tensor& y,
                  int64_t tile_bytes) {
    const int64_t N = n.size(0), K = x.size(1);
    const uint8_t* np = n.data_ptr<uint8_t>();
    const T* sp = so.data_ptr<T>();
    tiled_matmul<T>(x, y, tile_bytes, [&](T* tile, int64_t n0, int64_t n1) {
      dequantize_rows<T>(np, sp, tile, N, K, g, n0, n1);
    });
  }
};

at::Tensor int4_matmul_rows(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& so, int64_t group) {
  return int4_rows_op<WidenedCodes>(x, nibbles, so, group);
}

at::Tensor int4_matmul_tiled(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& so, int64_t group,
                             int64_t tile_bytes) {
  TORCH_CHECK(tile_bytes > 0, "tile_bytes must be positive");
  return int4_rows_op<DequantizedTiles>(x, nibbles, so, group, tile_bytes);
}

void int4_dequantize_out(const at::Tensor& nibbles, const at::Tensor& scales_and_offsets, int64_t group,
                         at::Tensor& out) {
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kByte, "nibbles [N, K/2] uint8 expected");
  const int64_t N = nibbles.size(0), K = nibbles.size(1) * 2;
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "the group size must be even and divide K");
  TORCH_CHECK(scales_and_offsets.dim() == 3 && scales_and_offsets.size(0) == K / group &&
                  scales_and_offsets.size(1) == N && scales_and_offsets.size(2) == 2,
              "scales_and_offsets [K/group, N, 2] expected");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == K &&
                  out.scalar_type() == scales_and_offsets.scalar_type(),
              "out [N, K] contiguous, of the scales' dtype expected");
  const at::Tensor nib = nibbles.contiguous(), so = scales_and_offsets.contiguous();
  const uint8_t* np = nib.data_ptr<uint8_t>();
  LLMOPT_DISPATCH(out, [&] {
    const scalar_t* sp = so.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      dequantize_rows<scalar_t>(np, sp, op + begin * K, N, K, group, begin, end);
    });
  });
}

}  // namespace llmopt_cpu::int4
