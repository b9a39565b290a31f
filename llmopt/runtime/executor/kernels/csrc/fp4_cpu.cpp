// FP4 (E2M1) weights in blocks of 16 or 32 with one-byte block scales (NVFP4: E4M3 under a global scale; MXFP4:
// E8M0 exponents), multiplied without a full-precision copy of the weight: the codes are decoded to fp32 in
// registers through a 16-entry table (one permute per 16 codes), scaled once per block.
//
// nibbles [N, K/2] uint8 (column 2j in the low nibble of byte j: core.contract.fp4.pack_nibbles), scale_bytes [N, K/group]
// uint8, scale_table [256] float32 (the effective scale of each scale byte, the global scale folded in:
// core.contract.fp4.block_scale_table). W[n, k] = E2M1[code] * scale_table[scale_bytes[n, k / group]].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"
#include "simd.h"

namespace llmopt_cpu::fp4 {  // entry points declared in ops.h, registered in register.cpp

using namespace llmopt_cpu;

namespace {

alignas(64) constexpr float kE2M1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                         -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
constexpr int64_t kBlock = 16;  // columns per vector step: 8 bytes of codes

#if defined(LLMOPT_VEC)
// 16 code bytes (each 0-15) -> their 16 E2M1 values
inline Vec decode16(__m128i codes) {
#if defined(__AVX512F__)
  return {_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), _mm512_load_ps(kE2M1))};
#else
  // the magnitude from the low 3 bits (permutevar8x32 reads only those), the sign bit 3 moved to bit 31
  const __m256 magnitudes = _mm256_load_ps(kE2M1);
  auto decode8 = [&](__m256i c) {
    const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(c, 3), 31);
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, c), _mm256_castsi256_ps(sign));
  };
  return {decode8(_mm256_cvtepu8_epi32(codes)), decode8(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)))};
#endif
}

// 8 bytes of codes (16 columns) -> (low nibbles, high nibbles) as 16 bytes in either order
inline __m128i split_nibbles(const uint8_t* p, bool natural_order) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  // natural: columns 0..15; else the 8 even columns, then the 8 odd ones (no interleave: x is permuted instead)
  return natural_order ? _mm_unpacklo_epi8(lo, hi) : _mm_unpacklo_epi64(lo, hi);
}
#endif

inline float code_value(const uint8_t* row, int64_t k) { return kE2M1[(row[k / 2] >> ((k % 2) * 4)) & 0xF]; }

// MB rows x NB outputs: per block of `group` columns, fp32 vector sums of x * value, scaled once by the block's
// scale into the totals (one horizontal sum per output at the end). xp: the rows with each 16 columns reordered
// evens-then-odds (the order split_nibbles gives the codes in).
template <int MB, int NB>
inline void fp4_outputs(const float* xp, const float* x, int64_t x_stride, const uint8_t* nibbles,
                        const uint8_t* scale_bytes, const float* table, float* y, int64_t y_stride, int64_t K,
                        int64_t group, int64_t n) {
  const int64_t groups = K / group, half = K / 2;
  float out[MB][NB] = {};
#if defined(LLMOPT_VEC)
  Vec total[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) total[m][j] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    Vec acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) acc[m][j] = vzero();
    for (int64_t c = g * group; c < (g + 1) * group; c += kBlock) {
      Vec w[NB];
      for (int j = 0; j < NB; ++j) w[j] = decode16(split_nibbles(nibbles + (n + j) * half + c / 2, false));
      for (int m = 0; m < MB; ++m) {
        const Vec xv = load16(xp + m * x_stride + c);
        for (int j = 0; j < NB; ++j) acc[m][j] = vfma(xv, w[j], acc[m][j]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const Vec s = vset1(table[scale_bytes[(n + j) * groups + g]]);
      for (int m = 0; m < MB; ++m) total[m][j] = vfma(s, acc[m][j], total[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) out[m][j] = reduce_add(total[m][j]);
#else
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      const uint8_t* row = nibbles + (n + j) * half;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) dot += x[m * x_stride + k] * code_value(row, k);
        out[m][j] += table[scale_bytes[(n + j) * groups + g]] * dot;
      }
    }
#endif
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) y[m * y_stride + n + j] = out[m][j];
}

template <int MB>
void fp4_rows_block(const float* xp, const float* x, int64_t x_stride, const uint8_t* nibbles,
                    const uint8_t* scale_bytes, const float* table, float* y, int64_t y_stride, int64_t K,
                    int64_t group, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if constexpr (MB == 1)
    for (; n + 4 <= n_end; n += 4)
      fp4_outputs<MB, 4>(xp, x, x_stride, nibbles, scale_bytes, table, y, y_stride, K, group, n);
  for (; n + 2 <= n_end; n += 2)
    fp4_outputs<MB, 2>(xp, x, x_stride, nibbles, scale_bytes, table, y, y_stride, K, group, n);
  for (; n < n_end; ++n) fp4_outputs<MB, 1>(xp, x, x_stride, nibbles, scale_bytes, table, y, y_stride, K, group, n);
}

template <typename T>
void fp4_rows_impl(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scale_bytes,
                   const at::Tensor& table, int64_t group, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = nibbles.size(0);
  const T* xp = x.data_ptr<T>();
  // once per call: the rows in fp32, natural order (scalar loops) and each 16 columns evens-then-odds (vectors)
  std::vector<float> xf(M * K), xperm(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const float v = to_float(xp[m * K + k]);
      xf[m * K + k] = v;
      const int64_t base = k - k % kBlock, j = k % kBlock;
      xperm[m * K + base + (j % 2) * (kBlock / 2) + j / 2] = v;
    }
  const uint8_t* np = nibbles.data_ptr<uint8_t>();
  const uint8_t* sp = scale_bytes.data_ptr<uint8_t>();
  const float* tp = table.data_ptr<float>();
  std::vector<float> out(M * N);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += 2) {  // rows in pairs: each pair decodes the codes once
      const float *e = xperm.data() + m0 * K, *f = xf.data() + m0 * K;
      if (M - m0 >= 2) fp4_rows_block<2>(e, f, K, np, sp, tp, out.data() + m0 * N, N, K, group, begin, end);
      else fp4_rows_block<1>(e, f, K, np, sp, tp, out.data() + m0 * N, N, K, group, begin, end);
    }
  });
  T* yp = y.data_ptr<T>();
  for (int64_t i = 0; i < M * N; ++i) yp[i] = from_float<T>(out[i]);
}

template <typename T>
void dequantize_rows(const uint8_t* nibbles, const uint8_t* scale_bytes, const float* table, T* out, int64_t K,
                     int64_t group, int64_t begin, int64_t end) {
  const int64_t groups = K / group, half = K / 2;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = nibbles + n * half;
    T* o = out + n * K;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = table[scale_bytes[n * groups + g]];
      int64_t k = g * group;
#if defined(LLMOPT_VEC)
      for (; k + kBlock <= (g + 1) * group; k += kBlock)
        store16(o + k, decode16(split_nibbles(row + k / 2, true)) * vset1(scale));  // v * s, rounded once to T
#endif
      for (; k < (g + 1) * group; ++k) o[k] = from_float<T>(code_value(row, k) * scale);
    }
  }
}

void check_operands(const at::Tensor& nibbles, const at::Tensor& scale_bytes, const at::Tensor& table, int64_t group) {
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kByte && nibbles.is_contiguous(),
              "nibbles [N, K/2] contiguous uint8 expected");
  const int64_t N = nibbles.size(0), K = nibbles.size(1) * 2;
  TORCH_CHECK(group > 0 && group % kBlock == 0 && K % group == 0, "the block size must be a multiple of 16 dividing K");
  TORCH_CHECK(scale_bytes.dim() == 2 && scale_bytes.size(0) == N && scale_bytes.size(1) == K / group &&
                  scale_bytes.scalar_type() == at::kByte && scale_bytes.is_contiguous(),
              "scale_bytes [N, K/group] contiguous uint8 expected");
  TORCH_CHECK(table.numel() == 256 && table.scalar_type() == at::kFloat && table.is_contiguous(),
              "scale_table [256] float32 expected");
}

}  // namespace

at::Tensor fp4_matmul_rows(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scale_bytes,
                           const at::Tensor& table, int64_t group) {
  check_operands(nibbles, scale_bytes, table, group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == nibbles.size(1) * 2, "x [M, K] expected, K matching the codes");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), nibbles.size(0)}, x.options());
  LLMOPT_DISPATCH(xc, [&] { fp4_rows_impl<scalar_t>(xc, nibbles, scale_bytes, table, group, y); });
  return y;
}

void fp4_dequantize_out(const at::Tensor& nibbles, const at::Tensor& scale_bytes, const at::Tensor& table,
                        int64_t group, at::Tensor& out) {
  check_operands(nibbles, scale_bytes, table, group);
  const int64_t N = nibbles.size(0), K = nibbles.size(1) * 2;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == K, "out [N, K] contiguous expected");
  const uint8_t* np = nibbles.data_ptr<uint8_t>();
  const uint8_t* sp = scale_bytes.data_ptr<uint8_t>();
  const float* tp = table.data_ptr<float>();
  LLMOPT_DISPATCH(out, [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      dequantize_rows<scalar_t>(np, sp, tp, op, K, group, begin, end);
    });
  });
}

}  // namespace llmopt_cpu::fp4
