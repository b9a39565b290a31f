// Unstructured sparse weights (core/contract/sparse_bitmask.py, compressed-tensors' sparse-bitmask):
//   values: every row's non-zeros in column order, row after row (padded by 16 elements: the vector loads read
//           up to 16 past a row's last value), in the compute dtype;
//   bitmask [N, K/8] uint8: bit j of byte b = column 8b + j holds a value;
//   row_offsets [N] int64: where each row's values start.
// For each 16 columns the row's next values are expanded into their lanes (zeros elsewhere): one expand on
// AVX-512, a lane-index table per mask byte on AVX2 (simd.h's expand8), and multiplied with the inputs as they
// are (no gather), the pointer moving on by the mask's population count. The weight's bytes are (1 - sparsity)
// of the values plus one bit per weight, read once per call for all rows.
// - bitmask_matmul_rows (decode); bitmask_decompress_out (dense W for the GEMM); bitmask_matmul_tiled (an L2
//   tile at a time, tiled_gemm.h). x [M, K] in the values' dtype, y [M, N] in x's dtype, K a multiple of 16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "tiled_gemm.h"

namespace llmopt_cpu::sparse_bitmask {

using namespace llmopt_cpu;

#if defined(__AVX512F__)
constexpr int RB = 4, NB = 2;
// the next values of a row for 16 columns with keep bits `mask`; `v` moves past them
template <typename T>
inline Vec expanded16(const T*& v, uint32_t mask) {
  const Vec w = {_mm512_maskz_expand_ps(static_cast<__mmask16>(mask), load16(v).v)};
  v += __builtin_popcount(mask);
  return w;
}
#elif defined(LLMOPT_VEC)
constexpr int RB = 2, NB = 2;
inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const at::BFloat16* p) { return bf16x8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8f(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
template <typename T>
inline __m256 expanded8(const T*& v, uint32_t byte) {
  const __m256 w = expand8(load8f(v), byte);
  v += __builtin_popcount(byte);
  return w;
}
template <typename T>
inline Vec expanded16(const T*& v, uint32_t mask) {
  const __m256 lo = expanded8(v, mask & 0xFF);
  return {lo, expanded8(v, mask >> 8)};
}
#else
constexpr int RB = 2, NB = 1;
#endif

inline uint32_t mask16(const uint8_t* bits, int64_t k) { return bits[k / 8] | (static_cast<uint32_t>(bits[k / 8 + 1]) << 8); }

template <typename T, int MB, int NBB>
inline void bitmask_outputs(const float* x, const T* values, const uint8_t* bitmask, const int64_t* offsets,
                            float* y, int64_t N, int64_t K, int64_t n) {
#if defined(LLMOPT_VEC)
  Vec acc[MB][NBB];
  const T* v[NBB];
  for (int j = 0; j < NBB; ++j) {
    v[j] = values + offsets[n + j];
    for (int m = 0; m < MB; ++m) acc[m][j] = vzero();
  }
  for (int64_t k = 0; k < K; k += 16) {
    Vec w[NBB];
    for (int j = 0; j < NBB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(v[j] + 512), _MM_HINT_T0);  // (as the 2:4 kernel's prefetch)
      w[j] = expanded16(v[j], mask16(bitmask + (n + j) * (K / 8), k));
    }
    for (int m = 0; m < MB; ++m) {
      const Vec xv = load16(x + m * K + k);
      for (int j = 0; j < NBB; ++j) acc[m][j] = vfma(xv, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NBB; ++j) y[m * N + n + j] = reduce_add(acc[m][j]);
#else
  for (int j = 0; j < NBB; ++j) {
    float sum[MB] = {};
    const T* v = values + offsets[n + j];
    const uint8_t* bits = bitmask + (n + j) * (K / 8);
    for (int64_t k = 0; k < K; ++k)
      if ((bits[k / 8] >> (k % 8)) & 1) {
        const float w = to_float(*v++);
        for (int m = 0; m < MB; ++m) sum[m] += w * x[m * K + k];
      }
    for (int m = 0; m < MB; ++m) y[m * N + n + j] = sum[m];
  }
#endif
}

template <typename T>
void decompress_rows(const T* values, const uint8_t* bitmask, const int64_t* offsets, T* dense, int64_t K,
                     int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* v = values + offsets[n];
    const uint8_t* bits = bitmask + n * (K / 8);
    T* o = dense + (n - n0) * K;
#if defined(LLMOPT_VEC)
    for (int64_t k = 0; k < K; k += 16) store16(o + k, expanded16(v, mask16(bits, k)));
#else
    for (int64_t k = 0; k < K; ++k) o[k] = ((bits[k / 8] >> (k % 8)) & 1) ? *v++ : from_float<T>(0.f);
#endif
  }
}

void check_operands(const at::Tensor& values, const at::Tensor& bitmask, const at::Tensor& offsets) {
  TORCH_CHECK(values.dim() == 1, "values [nnz + 16] expected");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kByte && bitmask.size(1) % 2 == 0,
              "bitmask [N, K/8] uint8 with K a multiple of 16 expected");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.size(0) == bitmask.size(0),
              "row_offsets [N] int64 expected");
}

at::Tensor bitmask_op(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmask,
                      const at::Tensor& offsets, int64_t tile_bytes) {
  check_operands(values, bitmask, offsets);
  const int64_t N = bitmask.size(0), K = bitmask.size(1) * 8;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [M, K] expected, K = 8 x the bitmask's columns");
  TORCH_CHECK(x.scalar_type() == values.scalar_type(), "x and values must share a dtype");
  const at::Tensor xc = x.contiguous(), vc = values.contiguous(), bc = bitmask.contiguous(), oc = offsets.contiguous();
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  const int64_t* op = oc.data_ptr<int64_t>();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  LLMOPT_DISPATCH(xc, [&] {
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    if (tile_bytes == 0) {
      few_rows_by_output_blocks<scalar_t, RB, NB>(xc, y, [&](auto rows, auto outs, const float* xm, float* ym, int64_t n) {
        bitmask_outputs<scalar_t, decltype(rows)::value, decltype(outs)::value>(xm, vp, bp, op, ym, N, K, n);
      });
    } else {
      tiled_matmul<scalar_t>(xc, y, tile_bytes, [&](scalar_t* tile, int64_t n0, int64_t n1) {
        decompress_rows<scalar_t>(vp, bp, op, tile, K, n0, n1);
      });
    }
  });
  return y;
}

at::Tensor bitmask_matmul_rows(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmask,
                               const at::Tensor& row_offsets) {
  return bitmask_op(x, values, bitmask, row_offsets, 0);
}

at::Tensor bitmask_matmul_tiled(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmask,
                                const at::Tensor& row_offsets, int64_t tile_bytes) {
  TORCH_CHECK(tile_bytes > 0, "tile_bytes must be positive");
  return bitmask_op(x, values, bitmask, row_offsets, tile_bytes);
}

void bitmask_decompress_out(const at::Tensor& values, const at::Tensor& bitmask, const at::Tensor& row_offsets,
                            at::Tensor& out) {
  check_operands(values, bitmask, row_offsets);
  const int64_t N = bitmask.size(0), K = bitmask.size(1) * 8;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous() &&
                  out.scalar_type() == values.scalar_type(),
              "out [N, K] contiguous in the values' dtype expected");
  const at::Tensor vc = values.contiguous(), bc = bitmask.contiguous(), oc = row_offsets.contiguous();
  LLMOPT_DISPATCH(vc, [&] {
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    scalar_t* dp = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      decompress_rows<scalar_t>(vp, bc.data_ptr<uint8_t>(), oc.data_ptr<int64_t>(), dp + begin * K, K, begin, end);
    });
  });
}

}  // namespace llmopt_cpu::sparse_bitmask
