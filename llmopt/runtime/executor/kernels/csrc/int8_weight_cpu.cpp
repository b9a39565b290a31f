// Weight-only int8 products (one scale per output channel, inputs in the compute dtype):
//   w [n, k] = scale[n] * q[n, k] + shift[n]    (q signed int8; shift = (128 - zero) * scale, absent when symmetric:
//                                               quant_matmul.pack_int8)
// - int8_matmul_rows, few rows (decode): y[m, n] = scale[n] * sum_k x[m, k] q[n, k] + shift[n] * sum_k x[m, k],
//   the codes read once per call for all rows (the step is bound by reading the weight: 1 byte per weight instead
//   of fp32's 4), widened to fp32 in registers and multiplied with RB rows at a time. aten's int8 weight-only
//   kernel, which the runtime used before, is fast with bf16 inputs but ran 10-100x slower than the fp32 GEMM
//   with fp32 inputs;
// - int8_matmul_panels, batched rows from codes repacked in panels of 16 outputs (see below);
// - int8_matmul_tiled, batched rows: the weight dequantized tile by tile and each tile multiplied by all rows
//   with the BLAS GEMM while it is in L2 (tiled_gemm.h).
// Shapes: x [M, K]; codes [N, K] int8; scale [N] and shift [N] in x's dtype; y [M, N] in x's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <optional>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "tiled_gemm.h"

namespace llmopt_cpu::int8 {

using namespace llmopt_cpu;

// The inputs [M, K] in fp32 and each row's sum, once per call; and the fp32 results into y's dtype.
template <typename T>
void fp32_rows(const at::Tensor& x, std::vector<float>& xf, std::vector<float>& xsum) {
  const int64_t M = x.size(0), K = x.size(1);
  const T* xp = x.data_ptr<T>();
  xf.resize(M * K);
  xsum.assign(M, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      xf[m * K + k] = to_float(xp[m * K + k]);
      xsum[m] += xf[m * K + k];
    }
}

template <typename T>
void store_rows(const std::vector<float>& out, at::Tensor& y) {
  T* yp = y.data_ptr<T>();
  for (size_t i = 0; i < out.size(); ++i) yp[i] = from_float<T>(out[i]);
}

#if defined(__AVX512F__)
constexpr int RB = 4, NB = 4;  // rows x outputs per pass: 16 accumulators of 32 registers
#else
constexpr int RB = 2, NB = 2;  // AVX2: 8 accumulators in 16 of 16 registers with the codes and inputs
#endif

// rows m0..m0+MB of x (fp32 [M, K]) against outputs n..n+NBB
template <typename T, int MB, int NBB>
inline void int8_outputs(const float* x, const float* xsum, const int8_t* codes, const T* scale, const T* shift,
                         float* y, int64_t N, int64_t K, int64_t n) {
  float out[MB][NBB] = {};
  int64_t k = 0;
#if defined(LLMOPT_VEC)
  Vec acc[MB][NBB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NBB; ++j) acc[m][j] = vzero();
  for (; k + 16 <= K; k += 16) {
    Vec w[NBB];
    for (int j = 0; j < NBB; ++j) w[j] = load16_i8(codes + (n + j) * K + k);
    for (int m = 0; m < MB; ++m) {
      const Vec xv = load16(x + m * K + k);
      for (int j = 0; j < NBB; ++j) acc[m][j] = vfma(xv, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NBB; ++j) out[m][j] = reduce_add(acc[m][j]);
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NBB; ++j) out[m][j] += x[m * K + k] * static_cast<float>(codes[(n + j) * K + k]);
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NBB; ++j) {
      const float s = to_float(scale[n + j]), b = shift != nullptr ? to_float(shift[n + j]) : 0.f;
      y[m * N + n + j] = s * out[m][j] + b * xsum[m];
    }
}

template <typename T, int MB>
void int8_rows_block(const float* x, const float* xsum, const int8_t* codes, const T* scale, const T* shift, float* y,
                     int64_t N, int64_t K, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + NB <= end; n += NB) int8_outputs<T, MB, NB>(x, xsum, codes, scale, shift, y, N, K, n);
  for (; n < end; ++n) int8_outputs<T, MB, 1>(x, xsum, codes, scale, shift, y, N, K, n);
}

template <typename T>
void int8_rows_impl(const at::Tensor& x, const at::Tensor& codes, const T* scale, const T* shift, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  std::vector<float> xf, xsum;
  fp32_rows<T>(x, xf, xsum);
  const int8_t* cp = codes.data_ptr<int8_t>();
  std::vector<float> out(M * N);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    int64_t m = 0;
    for (; m + RB <= M; m += RB)
      int8_rows_block<T, RB>(xf.data() + m * K, xsum.data() + m, cp, scale, shift, out.data() + m * N, N, K, begin, end);
    for (; m < M; ++m)
      int8_rows_block<T, 1>(xf.data() + m * K, xsum.data() + m, cp, scale, shift, out.data() + m * N, N, K, begin, end);
  });
  store_rows<T>(out, y);
}

// W's rows n0..n1 into tile [n1 - n0, K], w = fma(q, scale, shift) rounded once to T
template <typename T>
void dequantize_rows(const int8_t* codes, const T* scale, const T* shift, T* tile, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = codes + n * K;
    T* o = tile + (n - n0) * K;
    const float s = to_float(scale[n]), b = shift != nullptr ? to_float(shift[n]) : 0.f;
    int64_t k = 0;
#if defined(LLMOPT_VEC)
    const Vec vs = vset1(s), vb = vset1(b);
    for (; k + 16 <= K; k += 16) store16(o + k, vfma(load16_i8(row + k), vs, vb));
#endif
    for (; k < K; ++k) o[k] = from_float<T>(std::fma(static_cast<float>(row[k]), s, b));
  }
}

// Batched rows from the codes repacked at load in panels of 16 outputs (quant_matmul.pack_int8_panels: codes
// [N/16, K, 16], per column k the 16 outputs' codes): each column widened once into one vector and multiplied
// by every row's input broadcast, PR rows of 16-output accumulators over the whole of K, the scale and shift
// applied once at the end (as int4_matmul_panels).
#if defined(__AVX512F__)
constexpr int PR = 16;
#else
constexpr int PR = 6;  // AVX2: 6 two-register accumulators of 16 registers
#endif

template <typename T, int MB>
void int8_panel_rows(const float* x, const float* xsum, int64_t K, const int8_t* codes, const T* scale,
                     const T* shift, float* y, int64_t N, int64_t n0) {
#if defined(LLMOPT_VEC)
  Vec acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const Vec w = load16_i8(codes + k * 16);
    for (int m = 0; m < MB; ++m) acc[m] = vfma(vset1(x[m * K + k]), w, acc[m]);
  }
  const Vec s = load16(scale + n0), b = shift != nullptr ? load16(shift + n0) : vzero();
  for (int m = 0; m < MB; ++m) store16(y + m * N + n0, vfma(b, vset1(xsum[m]), acc[m] * s));
#else
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < 16; ++i) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += x[m * K + k] * static_cast<float>(codes[k * 16 + i]);
      const float b = shift != nullptr ? to_float(shift[n0 + i]) : 0.f;
      y[m * N + n0 + i] = std::fma(b, xsum[m], sum * to_float(scale[n0 + i]));
    }
#endif
}

template <typename T>
void int8_panels_impl(const at::Tensor& x, const at::Tensor& codes, const T* scale, const T* shift, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0) * 16;
  std::vector<float> xf, xsum;
  fp32_rows<T>(x, xf, xsum);
  const int8_t* cp = codes.data_ptr<int8_t>();
  std::vector<float> out(M * N);
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      row_chunks<PR>(M, [&](auto rows, int64_t m) {
        int8_panel_rows<T, decltype(rows)::value>(xf.data() + m * K, xsum.data() + m, K, cp + p * K * 16, scale,
                                                  shift, out.data() + m * N, N, p * 16);
      });
  });
  store_rows<T>(out, y);
}

void check_inputs(const at::Tensor& x, int64_t K, int64_t N, const at::Tensor& scale,
                  const std::optional<at::Tensor>& shift) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [M, K] expected, K matching the codes");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == x.scalar_type(),
              "scale [N] in x's dtype expected");
  TORCH_CHECK(!shift.has_value() || (shift->dim() == 1 && shift->size(0) == N && shift->scalar_type() == x.scalar_type()),
              "shift [N] in x's dtype expected");
}

// checks, then y [M, N] in x's dtype; tile_bytes 0: the few-row kernel
at::Tensor int8_weight_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                          const std::optional<at::Tensor>& shift, int64_t tile_bytes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "codes [N, K] int8 expected");
  const int64_t N = codes.size(0), K = codes.size(1);
  check_inputs(x, K, N, scale, shift);
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scale.contiguous();
  const at::Tensor bc = shift.has_value() ? shift->contiguous() : at::Tensor();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  LLMOPT_DISPATCH(xc, [&] {
    const scalar_t* sp = sc.data_ptr<scalar_t>();
    const scalar_t* bp = bc.defined() ? bc.data_ptr<scalar_t>() : nullptr;
    if (tile_bytes == 0) {
      int8_rows_impl<scalar_t>(xc, cc, sp, bp, y);
    } else {
      const int8_t* cp = cc.data_ptr<int8_t>();
      tiled_matmul<scalar_t>(xc, y, tile_bytes, [&](scalar_t* tile, int64_t n0, int64_t n1) {
        dequantize_rows<scalar_t>(cp, sp, bp, tile, K, n0, n1);
      });
    }
  });
  return y;
}

at::Tensor int8_matmul_panels(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const std::optional<at::Tensor>& shift) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 16 && codes.scalar_type() == at::kChar,
              "panel codes [N/16, K, 16] int8 expected");
  const int64_t N = codes.size(0) * 16, K = codes.size(1);
  check_inputs(x, K, N, scale, shift);
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scale.contiguous();
  const at::Tensor bc = shift.has_value() ? shift->contiguous() : at::Tensor();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  LLMOPT_DISPATCH(xc, [&] {
    int8_panels_impl<scalar_t>(xc, cc, sc.data_ptr<scalar_t>(), bc.defined() ? bc.data_ptr<scalar_t>() : nullptr, y);
  });
  return y;
}

at::Tensor int8_matmul_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const std::optional<at::Tensor>& shift) {
  return int8_weight_op(x, codes, scale, shift, 0);
}

at::Tensor int8_matmul_tiled(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                             const std::optional<at::Tensor>& shift, int64_t tile_bytes) {
  TORCH_CHECK(tile_bytes > 0, "tile_bytes must be positive");
  return int8_weight_op(x, codes, scale, shift, tile_bytes);
}

}  // namespace llmopt_cpu::int8
