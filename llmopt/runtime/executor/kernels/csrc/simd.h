// Shared by the CPU kernels (csrc/*.cpp): scalar conversions, one 16-lane fp32 vector type with its loads,
// stores and roundings in each storage dtype, a vectorized exp, and the dtype dispatch of the ops' entry points.
//
// The same sources are compiled once per instruction set (cpu_ops.py: scalar, avx2, avx512, avx512_bf16) and
// the build that matches the CPU is loaded at run time. `Vec` is one __m512 on AVX-512 and two __m256 on AVX2
// + FMA + F16C, so every kernel is written once against it; LLMOPT_VEC is defined where either exists (the
// scalar build runs the plain loops). Everything here has internal linkage: builds for several instruction sets
// can live in one process (the tests load each) without their inline functions being merged.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define LLMOPT_VEC 1
#endif

// The torch op namespace of this build (llmopt_cpu_<isa>), passed by cpu_ops.py; the indirection expands it
// before TORCH_LIBRARY pastes it into its names.
#ifndef LLMOPT_NS
#define LLMOPT_NS llmopt_cpu
#endif
#ifndef LLMOPT_ISA
#define LLMOPT_ISA scalar
#endif
#define LLMOPT_STR_(x) #x
#define LLMOPT_STR(x) LLMOPT_STR_(x)

namespace llmopt_cpu {
namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }  // round to nearest even, as torch casts

// One E4M3 (float8_e4m3fn) code -> its value. Normal codes rebias the exponent (7 -> 127) in the bit pattern;
// subnormal ones (exponent field 0) are mantissa x 2^-9. (0x7F / 0xFF, NaN, are never stored.)
inline float e4m3_to_float(uint8_t code) {
  const uint32_t mag = code & 0x7F;
  float value;
  if (mag < 8) {
    value = static_cast<float>(mag) * (1.0f / 512);
  } else {
    const uint32_t bits = (mag << 20) + (120u << 23);
    std::memcpy(&value, &bits, 4);
  }
  return (code & 0x80) ? -value : value;
}

#if defined(LLMOPT_VEC)
// the sum of 8 lanes (both builds have AVX)
inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX512F__)
// ---- AVX-512: one register -------------------------------------------------------------------------
struct Vec {
  __m512 v;
};
using Mask = uint32_t;  // one bit per lane
inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline Vec vset1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, rounded once
inline Vec vfnma(Vec a, Vec b, Vec c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b, rounded once
inline Vec vmax(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec vmin(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
inline Mask nan_mask(Vec a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
inline Mask eq_mask(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
inline Vec load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline Vec load16(const at::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
// 16 int8 codes -> 16 floats
inline Vec load16_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// 16 E4M3 codes -> 16 floats (as e4m3_to_float). Shifted left by 7 into an fp16 pattern, an E4M3 code's
// exponent and mantissa bits are those of the fp16 value 2^-8 times its value (subnormals included: fp16's bias
// is 15, E4M3's 7), so one F16C conversion and a multiply by 256 decode it exactly.
inline __m256i e4m3_as_half_bits(__m256i b) {  // 16 codes, one per 16-bit lane
  return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                         _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
}
inline Vec load16_e4m3(const uint8_t* p) {
  const __m256i half = e4m3_as_half_bits(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return {_mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f))};
}
// 16 unsigned bytes -> 16 floats
inline Vec from_bytes(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }
// 16 bytes of two 4-bit codes each -> the 16 low codes and the 16 high codes as floats (one widening)
inline void nibbles16(const uint8_t* p, Vec& low, Vec& high) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)))};
  high = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
}
inline void store16(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline void store16(at::BFloat16* p, Vec a) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(a.v));
#else
  // round to nearest even on the bit pattern; NaN keeps a NaN pattern
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}
inline void store16(at::Half* p, Vec a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
}
inline Vec round_half_even(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec vabs(Vec a) { return {_mm512_abs_ps(a.v)}; }
// 16 integral values in [-128, 127] -> 16 int8
inline void store16_i8(int8_t* p, Vec a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a.v)));
}
inline Vec scale_by_pow2(Vec p, Vec n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p * 2^n, n integral

#elif defined(LLMOPT_VEC)
// ---- AVX2 + FMA + F16C: two registers of 8 lanes ----------------------------------------------------
struct Vec {
  __m256 lo, hi;
};
using Mask = uint32_t;
inline Vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec vfnma(Vec a, Vec b, Vec c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec vmin(Vec a, Vec b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline float reduce_add(Vec a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float reduce_max(Vec a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Mask masks(__m256 lo, __m256 hi) {
  return static_cast<Mask>(_mm256_movemask_ps(lo)) | (static_cast<Mask>(_mm256_movemask_ps(hi)) << 8);
}
inline Mask nan_mask(Vec a) { return masks(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)); }
inline Mask eq_mask(Vec a, Vec b) { return masks(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)); }
inline Vec load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8_to_float(__m128i raw) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)); }
inline Vec load16(const at::BFloat16* p) {
  return {bf16x8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          bf16x8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline Vec load16(const at::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline Vec from_bytes(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
inline Vec load16_i8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline __m256i e4m3_as_half_bits(__m256i b) {  // as the AVX-512 build's
  return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                         _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
}
inline Vec load16_e4m3(const uint8_t* p) {
  const __m256i half = e4m3_as_half_bits(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m256 k = _mm256_set1_ps(256.0f);
  return {_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(half)), k),
          _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(half, 1)), k)};
}
inline void nibbles16(const uint8_t* p, Vec& low, Vec& high) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i a = _mm256_cvtepu8_epi32(v), b = _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
  const __m256i mask = _mm256_set1_epi32(15);
  low = {_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b, mask))};
  high = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}
inline void store16(float* p, Vec a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
// 8 floats -> 8 bf16 bit patterns in the low 16 bits of each 32-bit lane, rounded to nearest even
inline __m256i bf16_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
inline void store16(at::BFloat16* p, Vec a) {
  // packus interleaves the 128-bit halves: [lo 0-3, hi 0-3, lo 4-7, hi 4-7]; the permute restores the order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(a.lo), bf16_bits(a.hi)), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}
inline void store16(at::Half* p, Vec a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT));
}
inline Vec round_half_even(Vec a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline Vec vabs(Vec a) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, mask), _mm256_and_ps(a.hi, mask)};
}
inline void store16_i8(int8_t* p, Vec a) {
  // int32 -> int16 (packs interleaves the 128-bit halves; the permute restores the order) -> int8
  const __m256i words = _mm256_permute4x64_epi64(
      _mm256_packs_epi32(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
}
// p * 2^n for integral n in [-126, 127] (exact, as scalef): 2^n built in the exponent field
inline __m256 pow2_8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec scale_by_pow2(Vec p, Vec n) { return {_mm256_mul_ps(p.lo, pow2_8(n.lo)), _mm256_mul_ps(p.hi, pow2_8(n.hi))}; }
#endif

#if defined(LLMOPT_VEC)

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 has no expand instruction: per mask byte, each lane's index among the kept values and whether it is kept
// (the sparse kernels' expansion of 8 columns from their packed values).
struct LaneTable {
  alignas(32) int32_t idx[256][8];
  alignas(32) int32_t keep[256][8];
  LaneTable() {
    for (int b = 0; b < 256; ++b) {
      int next = 0;
      for (int j = 0; j < 8; ++j) {
        const bool kept = (b >> j) & 1;
        idx[b][j] = kept ? next : 0;
        keep[b][j] = kept ? -1 : 0;
        next += kept;
      }
    }
  }
};
inline const LaneTable& lane_table() {
  static const LaneTable table;
  return table;
}
// lane j takes the next of `packed`'s values where bit j of `byte` is set, zero elsewhere
inline __m256 expand8(__m256 packed, uint32_t byte) {
  const LaneTable& table = lane_table();
  const __m256 spread = _mm256_permutevar8x32_ps(packed, _mm256_load_si256(reinterpret_cast<const __m256i*>(table.idx[byte])));
  return _mm256_and_ps(spread, _mm256_load_ps(reinterpret_cast<const float*>(table.keep[byte])));
}
#endif

// Rounds through the storage dtype, as a torch op that returns that dtype would.
template <typename T>
inline Vec round_to(Vec v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
#if defined(__AVX512BF16__)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v.v)), 16))};
#endif
  } else {
    alignas(64) T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}
// exp over all finite inputs (clamped to [-87, 88]): 2^n * poly(r), |r| <= ln2 / 2, degree-7 Taylor (relative
// error ~1e-7); the same values on every instruction set.
inline Vec exp16(Vec x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  const Vec n = round_half_even(x * vset1(1.44269504088896341f));
  Vec r = vfnma(n, vset1(0.693359375f), x);
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  Vec p = vset1(1.0f / 5040);
  p = vfma(p, r, vset1(1.0f / 720));
  p = vfma(p, r, vset1(1.0f / 120));
  p = vfma(p, r, vset1(1.0f / 24));
  p = vfma(p, r, vset1(1.0f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
  return scale_by_pow2(p, n);
}
#endif

// The largest |x| over a row of k values.
template <typename T>
inline float row_amax(const T* row, int64_t k) {
  float amax = 0.f;
  int64_t i = 0;
#if defined(LLMOPT_VEC)
  Vec peak = vzero();
  for (; i + 16 <= k; i += 16) peak = vmax(peak, vabs(load16(row + i)));
  amax = reduce_max(peak);
#endif
  for (; i < k; ++i) amax = std::max(amax, std::fabs(to_float(row[i])));
  return amax;
}

// A row's symmetric int8 codes: round_half_even(x / scale) (an exact division, as torch's) clamped to [lo, hi],
// 16 at a time where the build has vectors, with the same results as the scalar tail.
template <typename T>
inline void quantize_row_int8(const T* row, int64_t k, float scale, float lo, float hi, int8_t* out) {
  int64_t i = 0;
#if defined(LLMOPT_VEC)
  const Vec vs = vset1(scale), lowest = vset1(lo), highest = vset1(hi);
  for (; i + 16 <= k; i += 16) store16_i8(out + i, vmin(vmax(round_half_even(load16(row + i) / vs), lowest), highest));
#endif
  for (; i < k; ++i) out[i] = static_cast<int8_t>(std::min(hi, std::max(lo, std::nearbyint(to_float(row[i]) / scale))));
}

}  // namespace
}  // namespace llmopt_cpu

// Runs the lambda with scalar_t bound to the tensor's dtype (float32, bfloat16 or float16).
#define LLMOPT_DISPATCH(tensor, ...)                                                            \
  [&] {                                                                                         \
    switch (tensor.scalar_type()) {                                                             \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }                        \
      case at::kBFloat16: { using scalar_t = at::BFloat16; return __VA_ARGS__(); }              \
      case at::kHalf: { using scalar_t = at::Half; return __VA_ARGS__(); }                      \
      default: TORCH_CHECK(false, "float32, bfloat16 or float16 expected");                     \
    }                                                                                           \
  }()
