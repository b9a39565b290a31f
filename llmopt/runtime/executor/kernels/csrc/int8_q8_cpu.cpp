// int8 weights (one scale per output channel) times 8-bit activations with integer dot products: the product a W8
// weight-only layer computes when the engine rounds its inputs to 8 bits (--input-activations int8, the CPU
// default), llama.cpp's Q8_0 x Q8 scheme on a layout repacked at load. At decode it reads the same bytes as the
// float int8 kernels with far fewer instructions per weight; at 64 rows and more the integer dots do more
// multiply-adds per instruction than fp32 FMAs (fp32 GEMMs are compute-bound there, so an int8 weight that is
// widened to fp32 can at best tie them).
//
// Grouped weights (symmetric, one scale per output and group of G columns, G a multiple of 32: GPTQ's 8-bit groups, a
// logits head rounded per block of 32 as llama.cpp's Q8_0): scale [K/G, N], group-major so that a panel's 16 scales of
// one group are one load; each block's integer sum is scaled by the input's d times its group's weight scale:
//   y = sum_blocks d * scale[g(block)] * sum(w * xq)
//
// Layout (quant_matmul.pack_int8_q8): the outputs in panels of 16, the columns in chunks of 4. codes [N/16, K/4, 64]
// int8: in chunk c of panel p, bytes 4j..4j+3 are output 16p + j's columns 4c..4c+3; one 64-byte load gives every
// output of the panel a 32-bit lane of 4 codes, and one broadcast of 4 input bytes feeds all 16 lanes.
//
// Signed x signed bytes: the dot instructions multiply unsigned by signed bytes (maddubs, vpdpbusd), so each weight
// byte's sign moves onto the input byte: w * x = |w| * (sign(w) x). |w| <= 128 is an unsigned byte (-128 included),
// |x| <= 127 (the inputs are symmetric), so a pair of products stays within int16 (2 * 128 * 127 < 32768) and
// nothing saturates. The inputs are int4_matmul_q8's (int4::quantize_inputs): per row and block of `act_group`
// columns d = max|x| / 127, xq = round(x / d). Per row, output and 32-column block the sum of w * xq is exact in
// int32; then
//   y = scale * sum_blocks d * sum(w * xq) + shift * sum_blocks d * sum(xq)
// the dequantized weight's dot product with the rounded inputs (shift: the zero point's term, w = scale * q +
// shift; absent for symmetric weights).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <optional>

#include "ops.h"
#include "simd.h"
#include "work_queue.h"

namespace llmopt_cpu::int8 {

using namespace llmopt_cpu;
using int4::four_bytes;
using int4::Q8_BLOCK;  // columns per exact integer sum
using int4::Q8Inputs;
using int4::quantize_inputs;

constexpr int64_t CHUNK = 4;  // columns per 32-bit lane

// What follows the integer sums, per output: y = scale * sums + shift * sum(inputs); grouped weights: each block's
// sum times its group's scale (group_scale [K/G, N], G = group_blocks * 32), no shift
struct Epilogue {
  const float* scale;  // [N] (null when grouped)
  const float* shift;  // or null
  const float* group_scale = nullptr;
  int64_t group_blocks = 0;
};

// 16 int32 lanes, one per output of a panel. Codes: a chunk's 64 codes as |w| and sign, made once per row tile;
// Input: one row's 4 bytes broadcast to every lane.
#if defined(__AVX512F__)
struct QVec {
  __m512i v;
};
struct Codes {
  __m512i magnitude;  // |w|
  __mmask64 negative;  // the bytes whose w < 0
};
using Input = __m512i;
inline QVec qzero() { return {_mm512_setzero_si512()}; }
inline Codes qload(const int8_t* p) {
  const __m512i w = _mm512_loadu_si512(p);
  return {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)};
}
inline Input prepare(int32_t x4) { return _mm512_set1_epi32(x4); }
// per lane: acc += dot(|w|, sign(w) * x) over its 4 bytes
inline void qdot(QVec& acc, const Codes& w, Input x) {
  const __m512i signed_x = _mm512_mask_sub_epi8(x, w.negative, _mm512_setzero_si512(), x);
#if defined(__AVX512VNNI__)
  acc = {_mm512_dpbusd_epi32(acc.v, w.magnitude, signed_x)};
#else  // u8 x s8 pairs into s16 (no saturation, above), then into s32
  acc = {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(w.magnitude, signed_x),
                                                   _mm512_set1_epi16(1)))};
#endif
}
inline Vec to_vec(QVec a) { return {_mm512_cvtepi32_ps(a.v)}; }
#elif defined(LLMOPT_VEC)
struct QVec {
  __m256i lo, hi;
};
struct Codes {
  __m256i lo, hi, lo_magnitude, hi_magnitude;
};
using Input = __m256i;
inline QVec qzero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Codes qload(const int8_t* p) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  return {lo, hi, _mm256_abs_epi8(lo), _mm256_abs_epi8(hi)};
}
inline Input prepare(int32_t x4) { return _mm256_set1_epi32(x4); }
inline __m256i qdot_half(__m256i acc, __m256i w, __m256i magnitude, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w));  // (sign: 0 where w = 0)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline void qdot(QVec& acc, const Codes& w, Input x) {
  acc = {qdot_half(acc.lo, w.lo, w.lo_magnitude, x), qdot_half(acc.hi, w.hi, w.hi_magnitude, x)};
}
inline Vec to_vec(QVec a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
#endif

#if defined(LLMOPT_VEC)
// NP panels from panel p, rows m0..m0+MB: results into y (row stride N), rounded once to its dtype
template <int MB, int NP, bool GROUPED, typename T>
void q8_panels(const Q8Inputs& q, int64_t m0, const int8_t* codes, const Epilogue& e, int64_t act_group, int64_t p,
               T* y, int64_t N) {
  const int64_t K = q.K, chunks = K / CHUNK, blocks = K / Q8_BLOCK;
  Vec total[NP][MB];
  for (int i = 0; i < NP; ++i)
    for (int m = 0; m < MB; ++m) total[i][m] = vzero();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    QVec acc[NP][MB];
    for (int i = 0; i < NP; ++i)
      for (int m = 0; m < MB; ++m) acc[i][m] = qzero();
    for (int64_t c = blk * (Q8_BLOCK / CHUNK); c < (blk + 1) * (Q8_BLOCK / CHUNK); ++c) {
      Codes w[NP];
      for (int i = 0; i < NP; ++i) w[i] = qload(codes + ((p + i) * chunks + c) * 64);
      for (int m = 0; m < MB; ++m) {
        const Input in = prepare(four_bytes(q.xq.data() + (m0 + m) * K + c * CHUNK));
        for (int i = 0; i < NP; ++i) qdot(acc[i][m], w[i], in);
      }
    }
    Vec weight_scale[NP];  // (grouped: this block's group's scale for each panel's 16 outputs)
    if constexpr (GROUPED)
      for (int i = 0; i < NP; ++i) weight_scale[i] = load16(e.group_scale + (blk / e.group_blocks) * N + (p + i) * 16);
    for (int m = 0; m < MB; ++m) {
      const Vec d = vset1(q.d[(m0 + m) * q.act_groups + blk * Q8_BLOCK / act_group]);
      for (int i = 0; i < NP; ++i) {
        if constexpr (GROUPED)
          total[i][m] = vfma(to_vec(acc[i][m]), d * weight_scale[i], total[i][m]);
        else
          total[i][m] = vfma(to_vec(acc[i][m]), d, total[i][m]);
      }
    }
  }
  for (int i = 0; i < NP; ++i) {
    const Vec s = GROUPED ? vset1(1.f) : load16(e.scale + (p + i) * 16);
    for (int m = 0; m < MB; ++m) {
      Vec out = GROUPED ? total[i][m] : total[i][m] * s;
      if (e.shift != nullptr) out = vfma(load16(e.shift + (p + i) * 16), vset1(q.xsum[m0 + m]), out);
      store16(y + (m0 + m) * N + (p + i) * 16, out);
    }
  }
}
#endif

// The plain loops over the same layout and sums, in the same order (the scalar build)
template <typename T>
void q8_panel_scalar(const Q8Inputs& q, int64_t m, const int8_t* codes, const Epilogue& e,
                     int64_t act_group, int64_t p, T* y, int64_t N) {
  const int64_t K = q.K, chunks = K / CHUNK;
  for (int j = 0; j < 16; ++j) {
    float total = 0.f;
    for (int64_t blk = 0; blk < K / Q8_BLOCK; ++blk) {
      int32_t dot = 0;
      for (int64_t c = blk * (Q8_BLOCK / CHUNK); c < (blk + 1) * (Q8_BLOCK / CHUNK); ++c) {
        const int8_t* lane = codes + (p * chunks + c) * 64 + 4 * j;
        const int8_t* x = q.xq.data() + m * K + c * CHUNK;
        for (int b = 0; b < 4; ++b) dot += static_cast<int32_t>(lane[b]) * x[b];
      }
      const float d = q.d[m * q.act_groups + blk * Q8_BLOCK / act_group];
      const int64_t n = p * 16 + j;
      total = std::fma(static_cast<float>(dot),
                       e.group_scale != nullptr ? d * e.group_scale[(blk / e.group_blocks) * N + n] : d, total);
    }
    const int64_t n = p * 16 + j;
    float out = e.group_scale != nullptr ? total : total * e.scale[n];
    if (e.shift != nullptr) out = std::fma(e.shift[n], q.xsum[m], out);
    y[m * N + n] = from_float<T>(out);
  }
}

// all M rows of panels [begin, end) (int4::for_panel_tiles: the tiling int4_matmul_q8 uses)
template <typename T>
void q8_rows(const Q8Inputs& q, int64_t M, const int8_t* codes, const Epilogue& e, int64_t act_group,
             int64_t begin, int64_t end, T* y, int64_t N) {
#if defined(LLMOPT_VEC)
  int4::for_panel_tiles(M, begin, end, [&](int64_t m0, auto rows, auto panels, int64_t p) {
    if (e.group_scale != nullptr)
      q8_panels<decltype(rows)::value, decltype(panels)::value, true, T>(q, m0, codes, e, act_group, p, y, N);
    else
      q8_panels<decltype(rows)::value, decltype(panels)::value, false, T>(q, m0, codes, e, act_group, p, y, N);
  });
#else
  for (int64_t p = begin; p < end; ++p)
    for (int64_t m = 0; m < M; ++m) q8_panel_scalar(q, m, codes, e, act_group, p, y, N);
#endif
}

template <typename T>
void int8_q8_matmul_impl(const at::Tensor& x, const at::Tensor& codes, const Epilogue& e, int64_t act_group,
                         at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), panels = codes.size(0), N = panels * 16;
  // one rounded-input sum per row (the whole row is the zero point's group)
  const Q8Inputs q = quantize_inputs(x.data_ptr<T>(), M, K, K, act_group, M);
  const int8_t* cp = codes.data_ptr<int8_t>();
  T* yp = y.data_ptr<T>();
  // chunks of 4 panels: a panel's codes are 16 x K bytes, a chunk must stream more than that (and whole groups of
  // the panels for_panel_tiles takes at a time at one row)
  parallel_chunks(panels, 4, [&](int64_t begin, int64_t end) {
    q8_rows<T>(q, M, cp, e, act_group, begin, end, yp, N);
  });
}

at::Tensor int8_matmul_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                          const std::optional<at::Tensor>& shift, int64_t act_group) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 64 && codes.scalar_type() == at::kChar,
              "codes [N/16, K/4, 64] int8 expected");
  const int64_t K = codes.size(1) * CHUNK, N = codes.size(0) * 16;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [M, K] expected, K matching the codes");
  TORCH_CHECK(K % Q8_BLOCK == 0, "K must be a multiple of 32");
  TORCH_CHECK(act_group > 0 && act_group % Q8_BLOCK == 0 && K % act_group == 0,
              "the activation group must be a multiple of 32 dividing K");
  const bool grouped = scale.dim() == 2;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.size(-1) == N && (scale.dim() == 1 || grouped),
              "scale [N] or, for grouped weights, [K/G, N] float32 expected");
  const int64_t groups = grouped ? scale.size(0) : 1;
  TORCH_CHECK(!grouped || (groups > 0 && K % groups == 0 && (K / groups) % Q8_BLOCK == 0),
              "grouped scales need groups of a multiple of 32 columns dividing K");
  TORCH_CHECK(!shift.has_value() || (!grouped && shift->dim() == 1 && shift->size(0) == N &&
                                     shift->scalar_type() == at::kFloat),
              "shift [N] float32 expected (grouped weights are symmetric: no shift)");
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scale.contiguous();
  const at::Tensor hc = shift.has_value() ? shift->contiguous() : at::Tensor();
  Epilogue e{grouped ? nullptr : sc.data_ptr<float>(), shift.has_value() ? hc.data_ptr<float>() : nullptr};
  if (grouped) {
    e.group_scale = sc.data_ptr<float>();
    e.group_blocks = K / groups / Q8_BLOCK;
  }
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  LLMOPT_DISPATCH(xc, [&] { int8_q8_matmul_impl<scalar_t>(xc, cc, e, act_group, y); });
  return y;
}

}  // namespace llmopt_cpu::int8
