// int4 weights times 8-bit activations with integer dot products: the weight read once per call, ~3 instructions
// per 128 weights and row (llama.cpp's Q4 x Q8 scheme, on a layout repacked at load). Memory-bound at decode; at
// more rows the integer dots do 4x the multiply-adds per instruction of fp32 FMAs (faster than the fp32 GEMM at
// 64 rows on AVX-512; AMX's bf16 tiles win from ~32 rows).
//
// Layout (quant_matmul.pack_int4_q8): the outputs in panels of 16, the columns in chunks of 8. codes [N/16, K/8, 64]
// uint8: in chunk c of panel p, bytes 4j..4j+3 belong to output 16p + j, byte 4j + b holding column 8c + b in its
// low nibble and column 8c + 4 + b in its high one; so one 64-byte load gives every output of the panel a 32-bit
// lane of 4 low and 4 high codes, and one broadcast of 4 input bytes feeds all 16 lanes (vpdpbusd, or maddubs +
// madd without VNNI): no shuffles, no horizontal sums. scales_biases [N/16, K/group, 2, 16] fp16: per group the
// panel's 16 scales and 16 biases, w = q * scale + bias (the GPTQ / Q4_1 parametrisation, the checkpoint's fp16).
//
// Activations: per row and block of `act_group` columns (a multiple of 32), d = max|x| / 127 and xq = round(x / d).
// Per row, output and 32-column block, the sum of q * xq is exact in int32 (at most 32 * 15 * 127); then
//   y = sum_blocks scale * d * sum(q * xq) + sum_groups bias * sum_blocks d * sum(xq),
// exactly the dequantized weight's dot product with the rounded inputs (llama.cpp's Q8_1 keeps the same sum).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "work_queue.h"

#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace llmopt_cpu::int4 {

using namespace llmopt_cpu;

constexpr int64_t Q8_BLOCK = 32;  // columns per exact integer sum

// The 8-bit inputs of M rows: xq [M, K] in column order, d [M, K / act_group], xsum [M, K / group].
struct Q8Inputs {
  std::vector<int8_t> xq;
  std::vector<float> d, xsum;
  int64_t K, act_groups, groups;
};

// Rows [M, rows) (padding to a whole tile) stay zero: d = 0, xq = 0, their sums 0.
template <typename T>
Q8Inputs quantize_inputs(const T* x, int64_t M, int64_t K, int64_t group, int64_t act_group, int64_t rows) {
  Q8Inputs q{std::vector<int8_t>(rows * K), std::vector<float>(rows * (K / act_group)),
             std::vector<float>(rows * (K / group)), K, K / act_group, K / group};
  // rows are independent: at prefill sizes (thousands of rows) split across the threads
  at::parallel_for(0, M, 64, [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m) {
      const T* row = x + m * K;
      for (int64_t a = 0; a < q.act_groups; ++a) {
        int64_t k = a * act_group;
        float amax = 0.f;
  #if defined(LLMOPT_VEC)
        Vec vmaxabs = vzero();
        for (; k + 16 <= (a + 1) * act_group; k += 16) vmaxabs = vmax(vmaxabs, vabs(load16(row + k)));
        amax = reduce_max(vmaxabs);
  #endif
        for (; k < (a + 1) * act_group; ++k) amax = std::max(amax, std::fabs(to_float(row[k])));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        q.d[m * q.act_groups + a] = amax / 127.f;
        int8_t* out = q.xq.data() + m * K;
        k = a * act_group;
  #if defined(LLMOPT_VEC)
        for (; k + 16 <= (a + 1) * act_group; k += 16)
          store16_i8(out + k, round_half_even(load16(row + k) * vset1(inv)));
  #endif
        for (; k < (a + 1) * act_group; ++k) out[k] = static_cast<int8_t>(std::nearbyint(to_float(row[k]) * inv));
      }
      // per weight group, the rounded inputs' sum: the biases then meet the same inputs as the codes, so y is the
      // dequantized weight's dot product with the rounded inputs, whose error scales with w (centred), not with
      // the codes q (all positive)
      const int8_t* xq = q.xq.data() + m * K;
      for (int64_t g = 0; g < q.groups; ++g) {
        float sum = 0.f;
        for (int64_t blk = g * group / Q8_BLOCK; blk < (g + 1) * group / Q8_BLOCK; ++blk) {
          int32_t isum = 0;
          for (int64_t k = blk * Q8_BLOCK; k < (blk + 1) * Q8_BLOCK; ++k) isum += xq[k];
          sum += q.d[m * q.act_groups + blk * Q8_BLOCK / act_group] * static_cast<float>(isum);
        }
        q.xsum[m * q.groups + g] = sum;
      }
    }
  });
  return q;
}

// 16 int32 lanes, one per output of a panel
#if defined(__AVX512F__)
struct IVec {
  __m512i v;
};
inline IVec izero() { return {_mm512_setzero_si512()}; }
inline void split_codes(const uint8_t* p, IVec& lo, IVec& hi) {  // 64 bytes -> low and high nibbles, one per byte
  const __m512i v = _mm512_loadu_si512(p), mask = _mm512_set1_epi8(0x0F);
  lo = {_mm512_and_si512(v, mask)};
  hi = {_mm512_and_si512(_mm512_srli_epi16(v, 4), mask)};
}
// per lane: a += dot(lo's 4 codes, xl's 4 bytes); b += dot(hi's, xh's)
inline void dot8(IVec& a, IVec& b, IVec lo, IVec hi, int32_t xl, int32_t xh) {
#if defined(__AVX512VNNI__)
  a = {_mm512_dpbusd_epi32(a.v, lo.v, _mm512_set1_epi32(xl))};
  b = {_mm512_dpbusd_epi32(b.v, hi.v, _mm512_set1_epi32(xh))};
#else  // u8 x s8 pairs into s16 (at most 4 * 15 * 127: no saturation), then into s32
  const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo.v, _mm512_set1_epi32(xl)),
                                         _mm512_maddubs_epi16(hi.v, _mm512_set1_epi32(xh)));
  a = {_mm512_add_epi32(a.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
  (void)b;
#endif
}
inline Vec to_vec(IVec a, IVec b) { return {_mm512_cvtepi32_ps(_mm512_add_epi32(a.v, b.v))}; }
#elif defined(LLMOPT_VEC)
struct IVec {
  __m256i lo, hi;
};
inline IVec izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline void split_codes(const uint8_t* p, IVec& lo, IVec& hi) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  lo = {_mm256_and_si256(a, mask), _mm256_and_si256(b, mask)};
  hi = {_mm256_and_si256(_mm256_srli_epi16(a, 4), mask), _mm256_and_si256(_mm256_srli_epi16(b, 4), mask)};
}
// The u8 x s8 pairs summed in int16 over a block's 4 chunks (per chunk and 16-bit lane at most 2 x 2 x 15 x 127 =
// 7620, so 30480 for the block: no saturation), widened to int32 once per block in to_vec: 4 instructions per chunk
// and row instead of 6 (the sums are exact either way: the same bits).
inline __m256i dot8_half(__m256i acc, __m256i lo, __m256i hi, __m256i xl, __m256i xh) {
  return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
}
inline void dot8(IVec& a, IVec&, IVec lo, IVec hi, int32_t xl, int32_t xh) {
  const __m256i l = _mm256_set1_epi32(xl), h = _mm256_set1_epi32(xh);
  a = {dot8_half(a.lo, lo.lo, hi.lo, l, h), dot8_half(a.hi, lo.hi, hi.hi, l, h)};
}
// A chunk of a panel whose nibbles were split once (unpack_panel_nibbles): 128 bytes, the low then the high ones
inline void unpacked_codes(const uint8_t* p, IVec& lo, IVec& hi) {
  const __m256i* v = reinterpret_cast<const __m256i*>(p);
  lo = {_mm256_load_si256(v), _mm256_load_si256(v + 1)};
  hi = {_mm256_load_si256(v + 2), _mm256_load_si256(v + 3)};
}
// One panel's codes [K/8, 64] as [K/8, 128] bytes: per chunk its 64 low nibbles, then its 64 high ones
inline void unpack_panel_nibbles(const uint8_t* panel, int64_t chunks, uint8_t* out) {
  for (int64_t c = 0; c < chunks; ++c) {
    IVec lo, hi;
    split_codes(panel + c * 64, lo, hi);
    __m256i* o = reinterpret_cast<__m256i*>(out + c * 128);
    _mm256_store_si256(o, lo.lo);
    _mm256_store_si256(o + 1, lo.hi);
    _mm256_store_si256(o + 2, hi.lo);
    _mm256_store_si256(o + 3, hi.hi);
  }
}
inline Vec to_vec(IVec a, IVec) {  // (b unused: dot8 sums into a)
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_cvtepi32_ps(_mm256_madd_epi16(a.lo, ones)), _mm256_cvtepi32_ps(_mm256_madd_epi16(a.hi, ones))};
}
#endif

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(LLMOPT_VEC)
// NP panels from panel p, rows m0..m0+MB: results into y (row stride N), rounded once to its dtype. UNPACKED
// (AVX2, one panel): `codes` is panel p's nibbles split once by unpack_panel_nibbles; the same sums in the same
// order, so the same bits.
template <int MB, int NP, typename T, bool UNPACKED = false>
void q8_panels(const Q8Inputs& q, int64_t m0, const uint8_t* codes, const at::Half* sb, int64_t group,
               int64_t act_group, int64_t p, T* y, int64_t N) {
  static_assert(!UNPACKED || NP == 1, "one unpacked panel at a time");
  const int64_t K = q.K, groups = K / group, chunks = K / 8;
  // At one or two rows (memory-bound decode) the next call's panels are requested early, the same chunk and group
  // (each panel's codes and scales are a stream the hardware prefetcher picks up late: batch-1 int4 layers -8%);
  // with more rows the step is compute-bound and the extra requests cost more than they save. (A prefetch never
  // faults, past the end too.)
  const bool prefetch = !UNPACKED && MB <= 2 && m0 == 0;  // (an unpacked panel's next one: q8_rows_unpacked)
  Vec total[NP][MB];
  for (int i = 0; i < NP; ++i)
    for (int m = 0; m < MB; ++m) total[i][m] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    Vec scale[NP];
    for (int i = 0; i < NP; ++i) {
      const at::Half* s = sb + ((p + i) * groups + g) * 32;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(s + NP * groups * 32), _MM_HINT_T0);
      scale[i] = load16(s);
      const Vec bias = load16(s + 16);
      for (int m = 0; m < MB; ++m) total[i][m] = vfma(bias, vset1(q.xsum[(m0 + m) * groups + g]), total[i][m]);
    }
    for (int64_t blk = g * group / Q8_BLOCK; blk < (g + 1) * group / Q8_BLOCK; ++blk) {
      IVec a[NP][MB], b[NP][MB];
      for (int i = 0; i < NP; ++i)
        for (int m = 0; m < MB; ++m) a[i][m] = b[i][m] = izero();
      for (int64_t c = blk * 4; c < blk * 4 + 4; ++c) {
        IVec lo[NP], hi[NP];
        if constexpr (UNPACKED) {
#if !defined(__AVX512F__)
          unpacked_codes(codes + c * 128, lo[0], hi[0]);
#endif
        } else {
          for (int i = 0; i < NP; ++i) split_codes(codes + ((p + i) * chunks + c) * 64, lo[i], hi[i]);
        }
        if (prefetch)
          for (int i = 0; i < NP; ++i)
            _mm_prefetch(reinterpret_cast<const char*>(codes + ((p + NP + i) * chunks + c) * 64), _MM_HINT_T0);
        for (int m = 0; m < MB; ++m) {
          const int8_t* x = q.xq.data() + (m0 + m) * K + c * 8;
          const int32_t xl = four_bytes(x), xh = four_bytes(x + 4);
          for (int i = 0; i < NP; ++i) dot8(a[i][m], b[i][m], lo[i], hi[i], xl, xh);
        }
      }
      for (int m = 0; m < MB; ++m) {
        const Vec d = vset1(q.d[(m0 + m) * q.act_groups + blk * Q8_BLOCK / act_group]);
        for (int i = 0; i < NP; ++i) total[i][m] = vfma(to_vec(a[i][m], b[i][m]), scale[i] * d, total[i][m]);
      }
    }
  }
  for (int i = 0; i < NP; ++i)
    for (int m = 0; m < MB; ++m) store16(y + (m0 + m) * N + (p + i) * 16, total[i][m]);
}
#endif

// The plain loops over the same layout (the scalar build)
template <typename T>
void q8_panel_scalar(const Q8Inputs& q, int64_t m, const uint8_t* codes, const at::Half* sb, int64_t group,
                     int64_t act_group, int64_t p, T* y, int64_t N) {
  const int64_t K = q.K, groups = K / group, chunks = K / 8;
  for (int j = 0; j < 16; ++j) {
    float out = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const at::Half* s = sb + (p * groups + g) * 32;
      const float scale = static_cast<float>(s[j]), bias = static_cast<float>(s[16 + j]);
      out += bias * q.xsum[m * groups + g];
      for (int64_t blk = g * group / Q8_BLOCK; blk < (g + 1) * group / Q8_BLOCK; ++blk) {
        int32_t dot = 0;
        for (int64_t c = blk * 4; c < blk * 4 + 4; ++c) {
          const uint8_t* lane = codes + (p * chunks + c) * 64 + 4 * j;
          const int8_t* x = q.xq.data() + m * K + c * 8;
          for (int b = 0; b < 4; ++b) dot += (lane[b] & 0xF) * x[b] + (lane[b] >> 4) * x[4 + b];
        }
        out += scale * q.d[m * q.act_groups + blk * Q8_BLOCK / act_group] * static_cast<float>(dot);
      }
    }
    y[m * N + p * 16 + j] = from_float<T>(out);
  }
}

#if defined(LLMOPT_VEC)
#if defined(__AVX512F__)
constexpr int Q8_NP1 = 4, Q8_NP2 = 2;  // panels per call at one / two rows (32 vector registers)
#else
constexpr int Q8_NP1 = 2, Q8_NP2 = 1;  // (16)
#endif

// All M rows of panel p through `panels(m0, MB, NP, p)` (a generic lambda; MB rows from m0 and NP = 1 panel, both
// std::integral_constant) in row tiles of 4, 2, 1: the panel's codes stay in L1 across the tiles.
template <typename Panels>
void for_row_tiles(int64_t M, int64_t p, Panels panels) {
  using std::integral_constant;
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m;
    if (left >= 4) { panels(m, integral_constant<int, 4>{}, integral_constant<int, 1>{}, p); m += 4; }
    else if (left >= 2) { panels(m, integral_constant<int, 2>{}, integral_constant<int, 1>{}, p); m += 2; }
    else { panels(m, integral_constant<int, 1>{}, integral_constant<int, 1>{}, p); m += 1; }
  }
}

// Panels [begin, end) of all M rows through `panels` (as for_row_tiles'): at one or two rows several panels per call
// (more independent chains of dot products), else one panel at a time in row tiles (for_row_tiles).
// int4_matmul_q8's and int8_matmul_q8's (int8_q8_cpu.cpp) loops over their own layouts.
template <typename Panels>
void for_panel_tiles(int64_t M, int64_t begin, int64_t end, Panels panels) {
  using std::integral_constant;
  auto row_tiles = [&](int64_t p) { for_row_tiles(M, p, panels); };
  const int np = M == 1 ? Q8_NP1 : M == 2 ? Q8_NP2 : 1;
  int64_t p = begin;
  for (; p + np <= end; p += np) {
    if (M == 1) panels(0, integral_constant<int, 1>{}, integral_constant<int, Q8_NP1>{}, p);
    else if (M == 2) panels(0, integral_constant<int, 2>{}, integral_constant<int, Q8_NP2>{}, p);
    else row_tiles(p);
  }
  for (; p < end; ++p) row_tiles(p);  // the range's last panels
}
#endif

#if defined(LLMOPT_VEC) && !defined(__AVX512F__)
// From this many rows the AVX2 loop splits each panel's nibbles once into a buffer that every row tile then loads
// (4 loads instead of 2 loads, 2 shifts and 4 ands per chunk and tile: on a 2-core AVX2 EPYC, family 23, an ad-hoc
// C++ copy of the 4-row loop ran 25.6-25.9 against 23.9-24.1 G multiply-adds/s; the kernel at 1,024 rows +6-10%).
// At fewer rows the split is not repaid: each panel meets at most 3 row tiles (at 8 rows, a decode step's layers
// from memory took 26.2 ms against 24.6).
constexpr int64_t Q8_UNPACK_ROWS = 16;

// all M rows (M >= Q8_UNPACK_ROWS) of panels [begin, end), each panel's nibbles split once
template <typename T>
void q8_rows_unpacked(const Q8Inputs& q, int64_t M, const uint8_t* codes, const at::Half* sb, int64_t group,
                      int64_t act_group, int64_t begin, int64_t end, T* y, int64_t N) {
  const int64_t chunks = q.K / 8;
  struct alignas(32) Line { uint8_t b[128]; };
  std::vector<Line> buffer(chunks);  // [K/8, 128] bytes: 9 KB at K = 576, 24 KB at 1536 (L1 holds it)
  uint8_t* panel = buffer.data()->b;
  for (int64_t p = begin; p < end; ++p) {
    unpack_panel_nibbles(codes + p * chunks * 64, chunks, panel);
    // the next panel's codes requested into L2 while this one's row tiles run (a decode step's weights come from
    // memory: its split would otherwise wait on every line)
    if (p + 1 < end)
      for (int64_t off = 0; off < chunks * 64; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(codes + (p + 1) * chunks * 64 + off), _MM_HINT_T1);
    for_row_tiles(M, p, [&](int64_t m0, auto rows, auto, int64_t) {
      q8_panels<decltype(rows)::value, 1, T, true>(q, m0, panel, sb, group, act_group, p, y, N);
    });
  }
}
#endif

// all M rows of panels [begin, end)
template <typename T>
void q8_rows(const Q8Inputs& q, int64_t M, const uint8_t* codes, const at::Half* sb, int64_t group,
             int64_t act_group, int64_t begin, int64_t end, T* y, int64_t N) {
#if defined(LLMOPT_VEC)
#if !defined(__AVX512F__)
  if (M >= Q8_UNPACK_ROWS) return q8_rows_unpacked<T>(q, M, codes, sb, group, act_group, begin, end, y, N);
#endif
  for_panel_tiles(M, begin, end, [&](int64_t m0, auto rows, auto panels, int64_t p) {
    q8_panels<decltype(rows)::value, decltype(panels)::value, T>(q, m0, codes, sb, group, act_group, p, y, N);
  });
#else
  for (int64_t p = begin; p < end; ++p)
    for (int64_t m = 0; m < M; ++m) q8_panel_scalar(q, m, codes, sb, group, act_group, p, y, N);
#endif
}

template <typename T>
void int4_q8_matmul_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sb, int64_t group,
                         int64_t act_group, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), panels = codes.size(0), N = panels * 16;
  const Q8Inputs q = quantize_inputs(x.data_ptr<T>(), M, K, group, act_group, M);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = sb.data_ptr<at::Half>();
  T* yp = y.data_ptr<T>();
  // chunks of 4 panels at least: a panel's codes are only 8 x K bytes, a chunk must stream more than that (and
  // whole groups of the panels for_panel_tiles takes at a time at one or two rows)
  parallel_chunks(panels, 4, [&](int64_t begin, int64_t end) {
    q8_rows<T>(q, M, cp, sp, group, act_group, begin, end, yp, N);
  });
}

void check_q8_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_biases, int64_t group,
                   int64_t act_group) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 64 && codes.scalar_type() == at::kByte,
              "codes [N/16, K/8, 64] uint8 expected");
  const int64_t K = codes.size(1) * 8;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [M, K] expected, K matching the codes");
  TORCH_CHECK(group > 0 && group % Q8_BLOCK == 0 && K % group == 0, "the group must be a multiple of 32 dividing K");
  TORCH_CHECK(act_group > 0 && act_group % Q8_BLOCK == 0 && K % act_group == 0,
              "the activation group must be a multiple of 32 dividing K");
  TORCH_CHECK(scales_biases.dim() == 4 && scales_biases.size(0) == codes.size(0) &&
                  scales_biases.size(1) == K / group && scales_biases.size(2) == 2 && scales_biases.size(3) == 16 &&
                  scales_biases.scalar_type() == at::kHalf,
              "scales_biases [N/16, K/group, 2, 16] float16 expected");
}

at::Tensor int4_matmul_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_biases,
                          int64_t group, int64_t act_group) {
  check_q8_args(x, codes, scales_biases, group, act_group);
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scales_biases.contiguous();
  at::Tensor y = at::empty({x.size(0), codes.size(0) * 16}, x.options());
  LLMOPT_DISPATCH(xc, [&] { int4_q8_matmul_impl<scalar_t>(xc, cc, sc, group, act_group, y); });
  return y;
}

// --- the same product on AMX tiles -------------------------------------------------------------------------------
// Sapphire Rapids and later: one tdpbsud multiplies a tile of 16 rows x 32 signed input bytes by 32 x 16 unsigned
// codes into 16 x 16 int32 (8,192 multiply-adds; ~2x the VNNI loop's work per instruction at 16 rows, more beyond).
// The int32 sums are the VNNI loop's, and each is scaled and accumulated in the same order with the same fused
// operations, so the result is the `int4_matmul_q8` one bit for bit. Only the avx512_bf16 build carries it (every
// AMX CPU has AVX512_BF16); `amx_int8()` says whether this CPU and OS let it run.
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__linux__)
#define LLMOPT_AMX 1
#endif

#if defined(LLMOPT_AMX)
constexpr int64_t AMX_ROWS = 16;  // input rows per tile

// Tile registers, two sets: 0, 1 = C [16 rows, 16 int32]; 2, 3 = A [16 rows, 32 int8 inputs]; 4, 5 = B [8 rows,
// 16 outputs x 4 codes]
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 32, 32, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 8, 8};
};

// One panel's codes as B tiles, one per 32-column block: tile row 2c' holds chunk c's low nibbles (columns 8c..8c+3
// of each output: AMX's 4-byte groups), row 2c' + 1 its high ones (8c+4..8c+7). [K/32, 8, 64] bytes.
inline void unpack_panel(const uint8_t* panel, int64_t chunks, uint8_t* out) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512i v = _mm512_loadu_si512(panel + c * 64);
    _mm512_storeu_si512(out + c * 128, _mm512_and_si512(v, mask));
    _mm512_storeu_si512(out + c * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  }
}

// Block `blk`'s 16 x 16 products (one tdpbsud) into tile register `C` and then the buffer `c` (at C's next use
// the buffer has been read: see amx_panels)
#define LLMOPT_AMX_ISSUE(C, A, B, c)                                          \
  do {                                                                       \
    _tile_zero(C);                                                           \
    _tile_loadd(A, q.xq.data() + m0 * K + blk * Q8_BLOCK, K);                \
    _tile_loadd(B, b_tiles.data() + blk * 512, 64);                          \
    _tile_dpbsud(C, A, B);                                                   \
    _tile_stored(C, c, 64);                                                  \
  } while (0)

// Rows [0, rows) (a multiple of 16; the padding rows are zero) of panels [begin, end)
template <typename T>
__attribute__((target("amx-tile,amx-int8"))) void amx_panels(const Q8Inputs& q, int64_t M, int64_t rows,
                                                              const uint8_t* codes, const at::Half* sb, int64_t group,
                                                              int64_t act_group, int64_t begin, int64_t end, T* y,
                                                              int64_t N) {
  const int64_t K = q.K, groups = K / group, chunks = K / 8, blocks = K / Q8_BLOCK;
  TileConfig config;
  _tile_loadconfig(&config);
  std::vector<uint8_t> b_tiles(K * 16);
  alignas(64) int32_t c_tiles[2][16][16];
  for (int64_t p = begin; p < end; ++p) {
    unpack_panel(codes + p * chunks * 64, chunks, b_tiles.data());
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_ROWS) {
      Vec total[AMX_ROWS];
      for (int m = 0; m < AMX_ROWS; ++m) total[m] = vzero();
      // block b's sums into total, in the VNNI loop's order: its group's bias term first when b opens the group
      auto accumulate = [&](int64_t b, const int32_t (*c)[16]) {
        const int64_t g = b * Q8_BLOCK / group;
        const at::Half* s = sb + (p * groups + g) * 32;
        if (b * Q8_BLOCK % group == 0) {
          const Vec bias = load16(s + 16);
          for (int m = 0; m < AMX_ROWS; ++m) total[m] = vfma(bias, vset1(q.xsum[(m0 + m) * groups + g]), total[m]);
        }
        const Vec scale = load16(s);
        for (int m = 0; m < AMX_ROWS; ++m) {
          const Vec d = vset1(q.d[(m0 + m) * q.act_groups + b * Q8_BLOCK / act_group]);
          total[m] = vfma(Vec{_mm512_cvtepi32_ps(_mm512_load_si512(c[m]))}, scale * d, total[m]);
        }
      };
      // two tile sets in turn: block b's tile products run while block b - 1's sums are scaled (the tile unit's
      // latency hidden behind the vector work; one set alone waits on it every block)
      int64_t blk = 0;
      LLMOPT_AMX_ISSUE(0, 2, 4, c_tiles[0]);
      for (blk = 1; blk < blocks; ++blk) {
        if (blk & 1) LLMOPT_AMX_ISSUE(1, 3, 5, c_tiles[1]);
        else LLMOPT_AMX_ISSUE(0, 2, 4, c_tiles[0]);
        accumulate(blk - 1, c_tiles[(blk - 1) & 1]);
      }
      accumulate(blocks - 1, c_tiles[(blocks - 1) & 1]);
      for (int m = 0; m < AMX_ROWS && m0 + m < M; ++m) store16(y + (m0 + m) * N + p * 16, total[m]);
    }
  }
  _tile_release();
}
#undef LLMOPT_AMX_ISSUE

template <typename T>
void int4_q8_amx_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sb, int64_t group,
                      int64_t act_group, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), panels = codes.size(0), N = panels * 16;
  const int64_t rows = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
  const Q8Inputs q = quantize_inputs(x.data_ptr<T>(), M, K, group, act_group, rows);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = sb.data_ptr<at::Half>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    amx_panels<T>(q, M, rows, cp, sp, group, act_group, begin, end, yp, N);
  });
}
#endif

#if defined(LLMOPT_AMX)
// --- float inputs (bf16) on AMX-BF16 tiles: the codes dequantized a panel at a time -------------------------------
// The float path's numbers (w = q * scale + bias rounded to bf16, products summed in fp32) without writing the whole
// dequantized weight: each pair of panels (32 outputs) is dequantized once per block of rows into a buffer in the
// tiles' pair layout and multiplied by the block's rows, 32 at a time (4 accumulator tiles: 2 row tiles x 2
// panels), each tile summing all of K before one store.

// Panel p's weights as bf16 pairs: [K/2 rows][16 outputs][2], row r holding columns 2r and 2r + 1
inline void dequantize_panel_bf16(const uint8_t* panel, const at::Half* sb, int64_t p, int64_t group, int64_t K,
                                  uint16_t* out) {
  const __m512i nibble = _mm512_set1_epi32(0xF);
  // within a row, output j's two columns side by side: lanes j of the two 16-float vectors interleaved
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(interleave);
  const int64_t groups = K / group;
  for (int64_t g = 0; g < groups; ++g) {
    const at::Half* s = sb + (p * groups + g) * 32;
    const __m512 scale = load16(s).v, bias = load16(s + 16).v;
    for (int64_t c = g * group / 8; c < (g + 1) * group / 8; ++c) {
      const __m512i v = _mm512_loadu_si512(panel + c * 64);
      __m512 w[8];  // columns 8c .. 8c + 7, one float per output
      for (int b = 0; b < 4; ++b) {
        const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(v, 8 * b), nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 8 * b + 4), nibble);
        w[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), scale, bias);
        w[4 + b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), scale, bias);
      }
      for (int r = 0; r < 4; ++r) {  // row 4c + r: columns 8c + 2r, 8c + 2r + 1
        const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(w[2 * r + 1], w[2 * r]);
        _mm512_storeu_si512(out + (4 * c + r) * 32, _mm512_permutexvar_epi16(order, pair));
      }
    }
  }
}

// Tiles: 0-3 = C [16 rows, 16 fp32] (row tile i, panel j: 2i + j), 4, 5 = A [16 rows, 32 bf16] (row tiles 0, 1),
// 6, 7 = B [16 pair rows, 16 outputs x 2] (panels 0, 1): each A and B load feeds two products
struct alignas(64) Bf16TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// NM row tiles (16 NM rows from m0) times NP panels (from p, their pair rows in b[0], b[1]), all of K
template <int NM, int NP>
__attribute__((target("amx-tile,amx-bf16"))) void amx_bf16_block(const at::BFloat16* x, int64_t m0, int64_t M,
                                                                  int64_t K, const uint16_t* const* b,
                                                                  at::BFloat16* y, int64_t N, int64_t p) {
  alignas(64) float c_tiles[4][16][16];
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (NM > 1) _tile_zero(2);
  if constexpr (NM > 1 && NP > 1) _tile_zero(3);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    _tile_loadd(6, b[0] + kb * 512, 64);
    if constexpr (NP > 1) _tile_loadd(7, b[1] + kb * 512, 64);
    _tile_loadd(4, x + m0 * K + kb * 32, K * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NM > 1) {
      _tile_loadd(5, x + (m0 + 16) * K + kb * 32, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c_tiles[0], 64);
  if constexpr (NP > 1) _tile_stored(1, c_tiles[1], 64);
  if constexpr (NM > 1) _tile_stored(2, c_tiles[2], 64);
  if constexpr (NM > 1 && NP > 1) _tile_stored(3, c_tiles[3], 64);
  for (int i = 0; i < NM; ++i)
    for (int j = 0; j < NP; ++j)
      for (int r = 0; r < 16 && m0 + 16 * i + r < M; ++r)
        store16(y + (m0 + 16 * i + r) * N + (p + j) * 16, Vec{_mm512_load_ps(c_tiles[2 * i + j][r])});
}

template <int NP>
void amx_bf16_rows(const at::BFloat16* x, int64_t r0, int64_t r1, int64_t M, int64_t K, const uint16_t* const* b,
                   at::BFloat16* y, int64_t N, int64_t p) {
  int64_t m0 = r0;
  for (; m0 + 32 <= r1; m0 += 32) amx_bf16_block<2, NP>(x, m0, M, K, b, y, N, p);
  if (m0 < r1) amx_bf16_block<1, NP>(x, m0, M, K, b, y, N, p);
}

// x [rows, K] (rows a multiple of 16; those past M are padding, never stored), panels [begin, end)
__attribute__((target("amx-tile,amx-bf16"))) void amx_bf16_panels(const at::BFloat16* x, int64_t M, int64_t rows,
                                                                   int64_t K, const uint8_t* codes,
                                                                   const at::Half* sb, int64_t group, int64_t begin,
                                                                   int64_t end, at::BFloat16* y, int64_t N) {
  Bf16TileConfig config;
  _tile_loadconfig(&config);
  std::vector<uint16_t> buffer(K * 32);
  const uint16_t* b[2] = {buffer.data(), buffer.data() + K * 16};
  // at prefill sizes the rows go in blocks that stay in L2 across the panels (each pair of panels dequantized once
  // per block): streaming all rows' inputs again for every panel would cost more than the products
  const int64_t row_block = std::max<int64_t>(64, (1 << 20) / (K * 2) / 32 * 32);
  for (int64_t r0 = 0; r0 < rows; r0 += row_block) {
    const int64_t r1 = std::min(rows, r0 + row_block);
    for (int64_t p = begin; p < end; p += 2) {
      const int np = p + 1 < end ? 2 : 1;
      for (int j = 0; j < np; ++j)
        dequantize_panel_bf16(codes + (p + j) * (K / 8) * 64, sb, p + j, group, K, buffer.data() + j * K * 16);
      if (np == 2) amx_bf16_rows<2>(x, r0, r1, M, K, b, y, N, p);
      else amx_bf16_rows<1>(x, r0, r1, M, K, b, y, N, p);
    }
  }
  _tile_release();
}
#endif

// Whether this CPU has the AMX tiles with `feature` (CPUID.7.0:EDX bit: 25 INT8, 22 BF16) and the OS lets this
// process use them (Linux hands out the tile state only on request: ARCH_REQ_XCOMP_PERM for XTILEDATA). Asked
// once: every call of the AMX kernels checks it, and under a hypervisor `cpuid` traps (microseconds).
static bool amx_usable(int feature) {
#if defined(LLMOPT_AMX)
  static const unsigned edx = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1)) return 0u;  // AMX-TILE
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? d : 0u;
  }();
  return (edx >> feature) & 1;
#else
  (void)feature;
  return false;
#endif
}

bool amx_int8() { return amx_usable(25); }
bool amx_bf16() { return amx_usable(22); }

at::Tensor int4_matmul_q8_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_biases,
                              int64_t group, int64_t act_group) {
  TORCH_CHECK(amx_int8(), "int4_matmul_q8_amx needs AMX-INT8 (this CPU, OS or kernel build has none): use "
              "int4_matmul_q8");
  check_q8_args(x, codes, scales_biases, group, act_group);
  at::Tensor y = at::empty({x.size(0), codes.size(0) * 16}, x.options());
#if defined(LLMOPT_AMX)
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scales_biases.contiguous();
  LLMOPT_DISPATCH(xc, [&] { int4_q8_amx_impl<scalar_t>(xc, cc, sc, group, act_group, y); });
#endif
  return y;
}

at::Tensor int4_matmul_amx_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_biases,
                                int64_t group) {
  TORCH_CHECK(amx_bf16(), "int4_matmul_amx_bf16 needs AMX-BF16 (this CPU, OS or kernel build has none): use "
              "int4_matmul_panels");
  check_q8_args(x, codes, scales_biases, group, Q8_BLOCK);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "int4_matmul_amx_bf16 takes bfloat16 inputs");
  const int64_t M = x.size(0), K = x.size(1), panels = codes.size(0), N = panels * 16;
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(LLMOPT_AMX)
  const int64_t rows = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
  at::Tensor xp = x.contiguous();
  if (rows != M) xp = at::cat({xp, at::zeros({rows - M, K}, x.options())});  // whole row tiles (zeros: unstored)
  const at::Tensor cc = codes.contiguous(), sc = scales_biases.contiguous();
  const at::BFloat16* xptr = xp.data_ptr<at::BFloat16>();
  const uint8_t* cp = cc.data_ptr<uint8_t>();
  const at::Half* sp = sc.data_ptr<at::Half>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    amx_bf16_panels(xptr, M, rows, K, cp, sp, group, begin, end, yp, N);
  });
#endif
  return y;
}

}  // namespace llmopt_cpu::int4
