// 2:4 sparse weights (half of every group of 4 input columns kept; core/contract/sparse24.py):
//   values [N, K/2]: the kept values of each row in column order (fp32, bf16 or fp16: the compute dtype);
//   positions [N, K/32] int32: bits 2i..2i+1 of word j = the column within its group of 4 of value 16j + i.
// A chunk of 32 input columns holds 16 kept values and one position word.
// - sparse24_matmul_rows, few rows (decode, speculative verification): y[m, n] = sum_j values[n, j] x[m, col(j)].
//   The values and positions are read once per call for all rows (the step is bound by reading the weight: half
//   the values plus 4 bits per group instead of every value), and for each chunk the inputs the 16 values meet
//   are picked out of the chunk's 32 inputs in registers: one two-source permute on AVX-512, two permutes and a
//   blend on AVX2;
// - sparse24_decompress_out: W dense [N, K] (zeros in place) into a caller's buffer, for the dense GEMM;
// - sparse24_matmul_tiled, batched rows: W decompressed one L2-sized tile at a time, each tile multiplied by
//   all rows with the BLAS GEMM (tiled_gemm.h).
// The decompressing ones also take the bitmask as stored ([N, K/8] uint8, bit j of byte b = column 8b + j kept:
// 1/32 of fp32's bytes more, read by prefill only): fp32 values expand into their columns straight from it.
// Shapes: x [M, K] in the values' dtype; y [M, N] in x's dtype; K a multiple of 32. The same three for 2:4 weights
// whose kept values are 4-bit codes with group scales (sparse24_int4_*, below).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "tiled_gemm.h"

namespace llmopt_cpu::sparse24 {

using namespace llmopt_cpu;

constexpr int64_t CHUNK = 32;  // input columns per position word (16 kept values)

#if defined(__AVX512F__)
constexpr int RB = 4, NB = 2;  // rows x outputs per pass: 8 accumulators
// the 16 values' columns within the chunk's 32 inputs
struct Columns {
  __m512i idx;
};
inline Columns columns_of(uint32_t word) {
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i base = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512i within = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts),
                                          _mm512_set1_epi32(3));
  return {_mm512_add_epi32(within, base)};
}
// the 16 inputs of a chunk (x: its 32 inputs) that its 16 values multiply
inline Vec picked(const float* x, const Columns& c) {
  return {_mm512_permutex2var_ps(_mm512_loadu_ps(x), c.idx, _mm512_loadu_ps(x + 16))};
}
#elif defined(LLMOPT_VEC)
constexpr int RB = 2, NB = 2;  // AVX2: 4 two-register accumulators
struct Columns {
  __m256i lo, hi;  // values 0-7 pick from inputs 0-15, values 8-15 from inputs 16-31
};
inline Columns columns_of(uint32_t word) {
  const __m256i base = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12);
  const __m256i three = _mm256_set1_epi32(3);
  const __m256i w = _mm256_set1_epi32(static_cast<int>(word));
  const __m256i lo = _mm256_srlv_epi32(w, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
  const __m256i hi = _mm256_srlv_epi32(w, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30));
  return {_mm256_add_epi32(_mm256_and_si256(lo, three), base), _mm256_add_epi32(_mm256_and_si256(hi, three), base)};
}
// 8 of 16 inputs: the permute reads the index's low 3 bits from each half; bit 3 (moved to the sign) chooses
inline __m256 pick8(const float* x, __m256i idx) {
  const __m256 a = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x), idx);
  const __m256 b = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + 8), idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
inline Vec picked(const float* x, const Columns& c) { return {pick8(x, c.lo), pick8(x + 16, c.hi)}; }
#else
constexpr int RB = 2, NB = 1;
#endif

// rows x[0..MB) (fp32, row stride K) against outputs n..n+NBB; y row stride N. `weights` gives a chunk's 16 kept
// weights of an output: vec(n, c) as a vector (and prefetches ahead), at(n, c, i) one at a time (scalar build).
template <int MB, int NBB, typename Weights>
inline void picked_outputs(const float* x, const int32_t* positions, const Weights& weights, float* y, int64_t N,
                           int64_t K, int64_t n) {
  const int64_t chunks = K / CHUNK;
#if defined(LLMOPT_VEC)
  Vec acc[MB][NBB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NBB; ++j) acc[m][j] = vzero();
  for (int64_t c = 0; c < chunks; ++c) {
    Vec w[NBB];
    Columns cols[NBB];
    for (int j = 0; j < NBB; ++j) {
      w[j] = weights.vec(n + j, c, 2 * NBB);
      cols[j] = columns_of(static_cast<uint32_t>(positions[(n + j) * chunks + c]));
    }
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NBB; ++j) acc[m][j] = vfma(picked(x + m * K + c * CHUNK, cols[j]), w[j], acc[m][j]);
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NBB; ++j) y[m * N + n + j] = reduce_add(acc[m][j]);
#else
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NBB; ++j) {
      float sum = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint32_t word = static_cast<uint32_t>(positions[(n + j) * chunks + c]);
        for (int i = 0; i < 16; ++i)
          sum += weights.at(n + j, c, i) * x[m * K + c * CHUNK + (i / 2) * 4 + ((word >> (2 * i)) & 3)];
      }
      y[m * N + n + j] = sum;
    }
#endif
}

// the kept values as stored (fp32, bf16 or fp16)
template <typename T>
struct ValueWeights {
  const T* values;  // [N, K/2]
  int64_t half;  // K/2
#if defined(LLMOPT_VEC)
  // `ahead` outputs on, the prefetch: with the hardware prefetcher alone each core streamed ~20% slower than the
  // dense GEMV (SmolLM2's linears, batch 1: 0.65x of dense fp32's time, 0.55x with it; 0.53x of the bytes)
  Vec vec(int64_t n, int64_t c, int ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(values + (n + ahead) * half + c * 16), _MM_HINT_T0);
    return load16(values + n * half + c * 16);
  }
#endif
  float at(int64_t n, int64_t c, int i) const { return to_float(values[n * half + c * 16 + i]); }
};

// W's rows n0..n1 into dense [n1 - n0, K] in T (zeros in place), each kept weight rounded once to T. fp32
// expands each chunk's 16 weights into its 32 columns from the bitmask (bit j of byte b = column 8b + j kept;
// exactly 8 of every 16): 16 columns per expand on AVX-512, 8 on AVX2 (simd.h's expand8); other dtypes and the
// scalar build scatter them by position.
template <typename T, typename Weights>
void decompress_rows(const Weights& weights, const int32_t* positions, const uint8_t* bitmask, T* dense, int64_t K,
                     int64_t n0, int64_t n1) {
  const int64_t chunks = K / CHUNK;
#if defined(LLMOPT_VEC)
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t n = n0; n < n1; ++n) {
      float* o = dense + (n - n0) * K;
      const uint8_t* b = bitmask + n * (K / 8);
      for (int64_t c = 0; c < chunks; ++c, o += CHUNK, b += 4) {
        const Vec w = weights.vec(n, c, 0);
#if defined(__AVX512F__)
        _mm512_storeu_ps(o, _mm512_maskz_expand_ps(static_cast<__mmask16>(b[0] | (b[1] << 8)), w.v));
        _mm512_storeu_ps(o + 16, _mm512_maskz_expand_ps(static_cast<__mmask16>(b[2] | (b[3] << 8)),
                                                        _mm512_castps256_ps512(_mm512_extractf32x8_ps(w.v, 1))));
#else
        _mm256_storeu_ps(o, expand8(w.lo, b[0]));  // (4 values per 8 columns)
        _mm256_storeu_ps(o + 8, expand8(_mm256_permute2f128_ps(w.lo, w.lo, 1), b[1]));
        _mm256_storeu_ps(o + 16, expand8(w.hi, b[2]));
        _mm256_storeu_ps(o + 24, expand8(_mm256_permute2f128_ps(w.hi, w.hi, 1), b[3]));
#endif
      }
    }
    return;
  }
#endif
  (void)bitmask;
  std::memset(static_cast<void*>(dense), 0, sizeof(T) * (n1 - n0) * K);
  for (int64_t n = n0; n < n1; ++n) {
    T* o = dense + (n - n0) * K;
    for (int64_t c = 0; c < chunks; ++c) {
      const uint32_t word = static_cast<uint32_t>(positions[n * chunks + c]);
      for (int i = 0; i < 16; ++i)
        o[c * CHUNK + (i / 2) * 4 + ((word >> (2 * i)) & 3)] = from_float<T>(weights.at(n, c, i));
    }
  }
}

// y [M, N] = x @ W^T for the 2:4 W that `weights` and `positions` give: without a bitmask the few-row kernel,
// with one W decompressed an L2 tile at a time (tiled_gemm.h)
template <typename T, typename Weights>
void sparse_product(const at::Tensor& x, const int32_t* positions, const Weights& weights, const uint8_t* bitmask,
                    int64_t tile_bytes, at::Tensor& y) {
  const int64_t K = x.size(1), N = y.size(1);
  if (bitmask == nullptr) {
    few_rows_by_output_blocks<T, RB, NB>(x, y, [&](auto rows, auto outs, const float* xm, float* ym, int64_t n) {
      picked_outputs<decltype(rows)::value, decltype(outs)::value>(xm, positions, weights, ym, N, K, n);
    });
    return;
  }
  tiled_matmul<T>(x, y, tile_bytes, [&](T* tile, int64_t n0, int64_t n1) {
    decompress_rows<T>(weights, positions, bitmask, tile, K, n0, n1);
  });
}

// the whole W into out [N, K] (the "decompress" path's buffer)
template <typename T, typename Weights>
void decompress_all(const Weights& weights, const int32_t* positions, const uint8_t* bitmask, at::Tensor& out) {
  const int64_t K = out.size(1);
  T* dp = out.data_ptr<T>();
  at::parallel_for(0, out.size(0), 64, [&](int64_t begin, int64_t end) {
    decompress_rows<T>(weights, positions, bitmask, dp + begin * K, K, begin, end);
  });
}

// bitmask [N, K/8] uint8 where given
void check_bitmask(const std::optional<at::Tensor>& bitmask, int64_t N, int64_t K) {
  TORCH_CHECK(!bitmask.has_value() || (bitmask->scalar_type() == at::kByte && bitmask->dim() == 2 &&
                                       bitmask->size(0) == N && bitmask->size(1) == K / 8),
              "bitmask [N, K/8] uint8 expected");
}

void check_operands(const at::Tensor& values, const at::Tensor& positions,
                    const std::optional<at::Tensor>& bitmask = std::nullopt) {
  TORCH_CHECK(values.dim() == 2 && positions.dim() == 2 && positions.scalar_type() == at::kInt,
              "values [N, K/2] and positions [N, K/32] int32 expected");
  TORCH_CHECK(positions.size(0) == values.size(0) && values.size(1) == positions.size(1) * 16,
              "positions [N, K/32] must match values [N, K/2]");
  check_bitmask(bitmask, values.size(0), values.size(1) * 2);
}

// checks, then y [M, N] in x's dtype; no bitmask: the few-row kernel, else W decompressed tile by tile
at::Tensor sparse24_op(const at::Tensor& x, const at::Tensor& values, const at::Tensor& positions,
                       const std::optional<at::Tensor>& bitmask, int64_t tile_bytes) {
  check_operands(values, positions, bitmask);
  const int64_t N = values.size(0), K = values.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [M, K] expected, K = 2 x the values' columns");
  TORCH_CHECK(x.scalar_type() == values.scalar_type(), "x and values must share a dtype");
  const at::Tensor xc = x.contiguous(), vc = values.contiguous(), pc = positions.contiguous();
  const at::Tensor bc = bitmask.has_value() ? bitmask->contiguous() : at::Tensor();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  LLMOPT_DISPATCH(xc, [&] {
    sparse_product<scalar_t>(xc, pc.data_ptr<int32_t>(), ValueWeights<scalar_t>{vc.data_ptr<scalar_t>(), K / 2},
                             bc.defined() ? bc.data_ptr<uint8_t>() : nullptr, tile_bytes, y);
  });
  return y;
}

at::Tensor sparse24_matmul_rows(const at::Tensor& x, const at::Tensor& values, const at::Tensor& positions) {
  return sparse24_op(x, values, positions, std::nullopt, 0);
}

at::Tensor sparse24_matmul_tiled(const at::Tensor& x, const at::Tensor& values, const at::Tensor& positions,
                                 const at::Tensor& bitmask, int64_t tile_bytes) {
  TORCH_CHECK(tile_bytes > 0, "tile_bytes must be positive");
  return sparse24_op(x, values, positions, bitmask, tile_bytes);
}

void check_out(const at::Tensor& out, int64_t N, int64_t K) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
              "out [N, K] contiguous expected");
}

void sparse24_decompress_out(const at::Tensor& values, const at::Tensor& positions, const at::Tensor& bitmask,
                             at::Tensor& out) {
  check_operands(values, positions, bitmask);
  const int64_t K = values.size(1) * 2;
  check_out(out, values.size(0), K);
  TORCH_CHECK(out.scalar_type() == values.scalar_type(), "out in the values' dtype expected");
  const at::Tensor vc = values.contiguous(), pc = positions.contiguous(), bc = bitmask.contiguous();
  LLMOPT_DISPATCH(vc, [&] {
    decompress_all<scalar_t>(ValueWeights<scalar_t>{vc.data_ptr<scalar_t>(), K / 2}, pc.data_ptr<int32_t>(),
                             bc.data_ptr<uint8_t>(), out);
  });
}

// ---- 2:4 with 4-bit codes ----------------------------------------------------------------------------------
// codes [N, K/4] uint8: the kept values' codes, two per byte (value 2j in the low nibble of byte j, 2j + 1 in the
// high one), in the values' order; positions as above; scale and offset [N, G] fp32 per group of `group`
// columns (a multiple of 32): w = code * scale + offset (offset = -zero * scale); the decompressing ones also take
// the bitmask as stored. 16 codes are widened and scaled in registers per chunk, then meet their picked inputs as
// the fp32 values do.

#if defined(LLMOPT_VEC)
// the 16 codes of a chunk (8 bytes), in order, as floats
inline Vec codes16(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), nibble = _mm_set1_epi8(0x0F);
  return from_bytes(_mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble)));
}
#endif

inline float code_at(const uint8_t* chunk, int i) { return static_cast<float>((chunk[i / 2] >> (4 * (i % 2))) & 15); }

// the kept values' 4-bit codes with their group's scale and offset
struct CodeWeights {
  const uint8_t* codes;  // [N, K/4]
  const float *scale, *offset;  // [N, G]
  int64_t quarter, groups, per_group;  // K/4, G, chunks per group
#if defined(LLMOPT_VEC)
  Vec vec(int64_t n, int64_t c, int ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(codes + (n + ahead) * quarter + c * 8), _MM_HINT_T0);  // (as above)
    const int64_t g = n * groups + c / per_group;
    return vfma(codes16(codes + n * quarter + c * 8), vset1(scale[g]), vset1(offset[g]));
  }
#endif
  float at(int64_t n, int64_t c, int i) const {
    const int64_t g = n * groups + c / per_group;
    return std::fma(code_at(codes + n * quarter + c * 8, i), scale[g], offset[g]);
  }
};

void check_int4_operands(const at::Tensor& codes, const at::Tensor& positions, const at::Tensor& scale,
                         const at::Tensor& offset, int64_t group, const std::optional<at::Tensor>& bitmask) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "codes [N, K/4] uint8 expected");
  TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kInt && positions.size(0) == codes.size(0) &&
                  codes.size(1) == positions.size(1) * 8,
              "positions [N, K/32] int32 matching codes [N, K/4] expected");
  const int64_t K = codes.size(1) * 4;
  check_bitmask(bitmask, codes.size(0), K);
  TORCH_CHECK(group > 0 && group % CHUNK == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  for (const at::Tensor* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == codes.size(0) &&
                    t->size(1) == K / group,
                "scale and offset [N, K / group] float32 expected");
}

// the weights of contiguous codes, scale and offset
CodeWeights code_weights(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset, int64_t group) {
  const int64_t K = codes.size(1) * 4;
  return {codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), offset.data_ptr<float>(), K / 4, K / group,
          group / CHUNK};
}

at::Tensor sparse24_int4_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& positions,
                            const at::Tensor& scale, const at::Tensor& offset, const std::optional<at::Tensor>& bitmask,
                            int64_t group, int64_t tile_bytes) {
  check_int4_operands(codes, positions, scale, offset, group, bitmask);
  const int64_t K = codes.size(1) * 4;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [M, K] expected, K = 4 x the codes' columns");
  const at::Tensor cc = codes.contiguous(), sc = scale.contiguous(), oc = offset.contiguous();
  const CodeWeights weights = code_weights(cc, sc, oc, group);
  const at::Tensor xc = x.contiguous(), pc = positions.contiguous();
  const at::Tensor bc = bitmask.has_value() ? bitmask->contiguous() : at::Tensor();
  at::Tensor y = at::empty({x.size(0), codes.size(0)}, x.options());
  LLMOPT_DISPATCH(xc, [&] {
    sparse_product<scalar_t>(xc, pc.data_ptr<int32_t>(), weights, bc.defined() ? bc.data_ptr<uint8_t>() : nullptr,
                             tile_bytes, y);
  });
  return y;
}

at::Tensor sparse24_int4_matmul_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& positions,
                                     const at::Tensor& scale, const at::Tensor& offset, int64_t group) {
  return sparse24_int4_op(x, codes, positions, scale, offset, std::nullopt, group, 0);
}

at::Tensor sparse24_int4_matmul_tiled(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& positions,
                                      const at::Tensor& scale, const at::Tensor& offset, const at::Tensor& bitmask,
                                      int64_t group, int64_t tile_bytes) {
  TORCH_CHECK(tile_bytes > 0, "tile_bytes must be positive");
  return sparse24_int4_op(x, codes, positions, scale, offset, bitmask, group, tile_bytes);
}

void sparse24_int4_decompress_out(const at::Tensor& codes, const at::Tensor& positions, const at::Tensor& scale,
                                  const at::Tensor& offset, const at::Tensor& bitmask, int64_t group, at::Tensor& out) {
  check_int4_operands(codes, positions, scale, offset, group, bitmask);
  check_out(out, codes.size(0), codes.size(1) * 4);
  const at::Tensor cc = codes.contiguous(), sc = scale.contiguous(), oc = offset.contiguous();
  const CodeWeights weights = code_weights(cc, sc, oc, group);
  const at::Tensor pc = positions.contiguous(), bc = bitmask.contiguous();
  LLMOPT_DISPATCH(out, [&] {
    decompress_all<scalar_t>(weights, pc.data_ptr<int32_t>(), bc.data_ptr<uint8_t>(), out);
  });
}

}  // namespace llmopt_cpu::sparse24
