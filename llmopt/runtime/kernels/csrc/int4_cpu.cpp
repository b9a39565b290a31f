// int4 weights dequantized whole into a bf16 matrix, for the dense GEMM that then runs on the CPU's bf16
// matrix units: at 16+ rows (prefill chunks, large decode batches) that beats aten's int4 kernel, whose cost
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
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        const __m512 vs = _mm512_set1_ps(scale), vo = _mm512_set1_ps(offset), eight = _mm512_set1_ps(8.f);
        const __m128i low = _mm_set1_epi8(0x0F);
        for (; k + 32 <= (g + 1) * group; k += 32) {  // 16 bytes -> 32 codes in column order
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
          const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
          const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  // codes 0-15, 16-31
          const __m512 w0 = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)), eight), vs, vo);
          const __m512 w1 = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)), eight), vs, vo);
          _mm512_storeu_si512(o + k, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
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

TORCH_LIBRARY_FRAGMENT(llmopt_cpu, m) {
  m.def("int4_dequantize_out(Tensor nibbles, Tensor scales_and_offsets, int group, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(llmopt_cpu, CPU, m) { m.impl("int4_dequantize_out", int4_dequantize_out); }
