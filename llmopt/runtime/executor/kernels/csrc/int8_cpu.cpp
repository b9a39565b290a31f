// W8A8's element-wise halves around the integer GEMM (torch._int_mm), each one pass instead of the ~8 torch ops
// (abs, amax, div, round, clamp, casts; then int32 -> float and two products) that cost more than the GEMM itself
// at decode and prefill sizes alike:
// - quantize_rows_int8: per row (token) of x [M, K] (fp32 / bf16 / fp16), scale = amax / 127.5 (1 where the
//   row is zero) and codes round-half-even(x / scale) clamped to [-128, 127]: core.contract.activations'
//   formula, bit for bit (the same fp32 division);
// - scale_int32_rows: y [M, N] = (float(acc) * col_scale[n]) * row_scale[m], rounded once to the output dtype
//   (the same products, in the same order, as the torch path).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

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
      float amax = 0.f;
      for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(to_float(row[i])));
      float scale = amax / 127.5f;
      if (!(scale > 0.f)) scale = 1.f;
      scales[r] = scale;
      int8_t* out = codes + r * k;
      for (int64_t i = 0; i < k; ++i) {
        const float q = std::nearbyint(to_float(row[i]) / scale);  // round half to even, as torch.round
        out[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, q)));
      }
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

}  // namespace llmopt_cpu::int8
