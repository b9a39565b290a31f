// W8A8's element-wise halves around the integer GEMM (torch._int_mm), each one pass instead of the ~8 torch ops
// (abs, amax, div, round, clamp, casts; then int32 -> float and two products) that cost more than the GEMM itself
// at decode and prefill sizes alike:
// - quantize_rows_int8: per row (token) of x [M, K] (fp32 / bf16 / fp16), scale = amax / 127.5 (1 where the
//   row is zero) and codes round-half-even(x / scale) clamped to [-128, 127]: core.contract.activations'
//   formula, bit for bit (the same fp32 division);
// - scale_int32_rows: y [M, N] = (float(acc) * col_scale[n]) * row_scale[m], rounded once to the output dtype
//   (the same products, in the same order, as the torch path);
// - int8_gemv_rows: the whole W8A8 product for 1..8 rows (decode), y [M, N] from x [M, K] and int8 weights
//   [N, K] read once for all rows: each row quantized as above, exact int32 dot products (AVX512-VNNI vpdpbusd on
//   x + 128 with the weight row's sum taken back out; AVX2 / AVX-512 widen to int16 pairs, vpmaddwd), then the
//   same epilogue. At decode the product is memory bound and the weight is a quarter of fp32's bytes; oneDNN's
//   int8 GEMM pays a packing pass per call at these sizes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace llmopt_cpu::int8 {

using namespace llmopt_cpu;

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elements, 1));
}

template <typename T>
void quantize_rows(const T* x, int8_t* codes, float* scales, int64_t rows, int64_t k) {
  at::parallel_for(0, rows, grain_rows(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * k;
      float scale = row_amax(row, k) / 127.5f;
      if (!(scale > 0.f)) scale = 1.f;
      scales[r] = scale;
      quantize_row_int8(row, k, scale, -128.f, 127.f, codes + r * k);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x [rows, columns] expected");
  const at::Tensor xc = x.contiguous();
  at::Tensor codes = at::empty(xc.sizes(), xc.options().dtype(at::kChar));
  at::Tensor scales = at::empty({xc.size(0)}, xc.options().dtype(at::kFloat));
  LLMOPT_DISPATCH(xc, [&] {
    quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                            xc.size(0), xc.size(1));
  });
  return {codes, scales};
}

template <typename T>
void scale_rows(const int32_t* acc, const float* row_scale, const float* col_scale, T* out, int64_t rows,
                int64_t n) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a = acc + r * n;
      const float s = row_scale[r];
      T* o = out + r * n;
      for (int64_t j = 0; j < n; ++j) o[j] = from_float<T>((static_cast<float>(a[j]) * col_scale[j]) * s);
    }
  });
}

at::Tensor scale_int32_rows(const at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& col_scale,
                            at::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt, "acc [rows, columns] int32 expected");
  TORCH_CHECK(row_scale.numel() == acc.size(0) && col_scale.numel() == acc.size(1) &&
                  row_scale.scalar_type() == at::kFloat && col_scale.scalar_type() == at::kFloat,
              "float32 row_scale [rows] and col_scale [columns] expected");
  const at::Tensor a = acc.contiguous(), rs = row_scale.contiguous(), cs = col_scale.contiguous();
  at::Tensor out = at::empty(a.sizes(), a.options().dtype(dtype));
  LLMOPT_DISPATCH(out, [&] {
    scale_rows<scalar_t>(a.data_ptr<int32_t>(), rs.data_ptr<float>(), cs.data_ptr<float>(),
                         out.data_ptr<scalar_t>(), a.size(0), a.size(1));
  });
  return out;
}

constexpr int64_t GEMV_MAX_ROWS = 8;

// sum_k x[k] * w[k] over int8 vectors, exact in int32 (|x|, |w| <= 128, K < 2^17 keeps it in range)
inline int32_t dot_s8(const int8_t* x, const uint8_t* xu, const int8_t* w, int32_t w_sum, int64_t k) {
  int64_t i = 0;
  int32_t acc = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // u8 x s8 dot products: (x + 128) . w - 128 * sum(w)
  __m512i v = _mm512_setzero_si512();
  for (; i + 64 <= k; i += 64)
    v = _mm512_dpbusd_epi32(v, _mm512_loadu_si512(xu + i), _mm512_loadu_si512(w + i));
  acc = _mm512_reduce_add_epi32(v) - 128 * w_sum;
  if (i < k) {  // the tail in plain integers (w_sum covered the whole row: add the tail's own weights back)
    int32_t tail = 0, tail_w = 0;
    for (; i < k; ++i) { tail += static_cast<int32_t>(x[i]) * w[i]; tail_w += w[i]; }
    acc += tail + 128 * tail_w;
  }
  return acc;
#elif defined(__AVX2__)
  (void)xu; (void)w_sum;
  __m256i v = _mm256_setzero_si256();
  for (; i + 16 <= k; i += 16) {
    const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
    v = _mm256_add_epi32(v, _mm256_madd_epi16(a, b));
  }
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  acc = _mm_cvtsi128_si32(s);
#else
  (void)xu; (void)w_sum;
#endif
  for (; i < k; ++i) acc += static_cast<int32_t>(x[i]) * w[i];
  return acc;
}

template <typename T>
void gemv_rows(const T* x, const int8_t* w, const float* w_scale, const int32_t* w_sum, T* y, int64_t m, int64_t n,
               int64_t k) {
  std::vector<int8_t> codes(m * k);
  std::vector<uint8_t> shifted(m * k);
  std::vector<float> scales(m);
  quantize_rows<T>(x, codes.data(), scales.data(), m, k);
  for (int64_t i = 0; i < m * k; ++i) shifted[i] = static_cast<uint8_t>(codes[i] + 128);
  // parallel over output columns: each weight row is read once, for every input row
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int8_t* wj = w + j * k;
      for (int64_t r = 0; r < m; ++r) {
        const int32_t acc = dot_s8(codes.data() + r * k, shifted.data() + r * k, wj, w_sum[j], k);
        y[r * n + j] = from_float<T>((static_cast<float>(acc) * w_scale[j]) * scales[r]);
      }
    }
  });
}

at::Tensor int8_gemv_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                          const at::Tensor& weight_sum, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= GEMV_MAX_ROWS, "x [1..8, K] expected");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.size(1) == x.size(1) &&
                  weight.is_contiguous(), "a contiguous int8 weight [N, K] expected");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.numel() == weight.size(0) &&
                  weight_sum.scalar_type() == at::kInt && weight_sum.numel() == weight.size(0),
              "float32 weight_scale [N] and int32 weight_sum [N] expected");
  const at::Tensor xc = x.contiguous().to(dtype);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options().dtype(dtype));
  LLMOPT_DISPATCH(out, [&] {
    gemv_rows<scalar_t>(xc.data_ptr<scalar_t>(), weight.data_ptr<int8_t>(), weight_scale.data_ptr<float>(),
                        weight_sum.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), x.size(0), weight.size(0),
                        x.size(1));
  });
  return out;
}

}  // namespace llmopt_cpu::int8
