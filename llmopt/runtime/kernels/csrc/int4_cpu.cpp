// int4 weights dequantized whole into a dense matrix (bf16, fp16 or fp32), for the dense GEMM that then runs on
// the CPU's matrix or FMA units: at 16+ rows (prefill chunks, large decode batches) that beats aten's int4 kernel, whose cost
// grows linearly with the rows. The torch expression of the same arithmetic (quant_matmul.int4_dequantize) takes
// 1.5-3 ms per SmolLM2 linear; this one pass takes ~0.1-0.3 ms.
//
// nibbles [N, K/2] uint8 (column 2j in the low nibble of byte j, 2j+1 in the high one: quant_matmul.pack_nibbles),
// scales_and_offsets [K/group, N, 2] with w = (q - 8) * scale + offset per group (aten's int4 convention), written
// into out [N, K] (the dtype of scales_and_offsets) as fma(q - 8, scale, offset) in fp32, rounded once: in bf16
// the same bits as the torch expression.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "simd.h"

namespace {

using namespace llmopt_cpu;

template <typename T>
void dequantize_rows(const uint8_t* nibbles, const T* so, T* out, int64_t N, int64_t K, int64_t group,
                     int64_t begin, int64_t end) {
  const int64_t groups = K / group;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = nibbles + n * (K / 2);
    T* o = out + n * K;
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
      dequantize_rows<scalar_t>(np, sp, op, N, K, group, begin, end);
    });
  });
}

}  // namespace

LLMOPT_LIBRARY_FRAGMENT(LLMOPT_NS, m) {
  m.def("int4_dequantize_out(Tensor nibbles, Tensor scales_and_offsets, int group, Tensor(a!) out) -> ()");
}

LLMOPT_LIBRARY_IMPL(LLMOPT_NS, CPU, m) { m.impl("int4_dequantize_out", int4_dequantize_out); }
