// Causal attention of prompts over their own keys (prefill), from the step's q, k, v rows (CPU).
//
// torch's CPU flash attention splits the keys in blocks of 512: a prompt shorter than that computes its whole
// [len, len] score square and masks half of it away, and its tiles leave much of a 2-core machine's FMA rate unused
// (SmolLM2's 9 x 3 heads: ~360 us per 128-token prompt and layer, ~4.2 ms at 512 tokens). Here each work item is
// one sequence, one KV head and a block of query positions, all the group's query heads together (GQA: every key
// row packed once serves them all), and each micro-block of rows stops at its own causal limit.
//
// Shapes: q [S * new, num_heads, head_dim], k, v [S * ctx, num_kv_heads, head_dim] (S sequences; rows of one token
// contiguous, any token stride); query i of sequence s sits at position ctx - new + i and attends keys 0..that.
// Returns [S * new, num_heads, head_dim] in q's dtype. First every sequence's keys (transposed, in panels of KEY_TILE) and
// values are packed once, in chunks of 256 keys; then per item and chunk: scores = q . k for each register tile of
// MR rows up to its last row's limit, the running softmax of each row (max, sum, the factor by which its earlier
// output shrinks: the chunk stays in L2 at any context length), out += p . v in fp32; the output divided by the
// row's sum once at the end. fp32 FMAs, or with bf16 inputs on AVX512_BF16 bf16 pairs (score_tile_pairs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace llmopt_cpu::prefill {

using namespace llmopt_cpu;

#if defined(LLMOPT_VEC)
// Register tiles: MR query rows at once; the scores 16 * KV keys wide, the output 16 * DV columns wide. AVX-512
// (32 registers, one per Vec): 6 x 4 accumulators; AVX2 (16, two per Vec): 6 x 1.
#if defined(__AVX512F__)
constexpr int MR = 6, KV = 4, DV = 4;
#else
constexpr int MR = 6, KV = 1, DV = 1;
#endif
constexpr int64_t KEY_TILE = 16 * KV;

// Keys per chunk: the chunk's keys (transposed) and values in fp32 stay in L2 while every row tile of the item
// passes over them (64 KB each at head_dim 64), and a tile's scores [MR, KEY_CHUNK] in L1.
constexpr int64_t KEY_CHUNK = 4 * KEY_TILE * (4 / KV);

// Per thread: one item's queries, scores, probabilities, outputs and running softmax.
struct Buffers {
  std::vector<float> q, scores, o, max, sum, factor;
  std::vector<uint16_t> q16, p16;  // the bf16-pairs path's (see score_tile_pairs)
};

// Every sequence's keys and values, packed once per call for all the items that read them: per (sequence, KV
// head) its keys padded to whole panels, in chunks of KEY_CHUNK keys, the keys in panels and the values (fp32, or
// the raw bf16 pairs). Kept per calling thread between calls (grown, never shrunk): a fresh buffer each layer
// would be zeroed and page-faulted in again (~6 MB for 16 prompts of 128 tokens).
struct Packed {
  std::vector<float> kt, v;
  std::vector<uint16_t> kt16, v16;
  int64_t per_head;  // elements per (sequence, KV head)
  int64_t at(int64_t s, int64_t h, int64_t chunk, int64_t kv_heads, int64_t D) const {
    return (s * kv_heads + h) * per_head + chunk * KEY_CHUNK * D;
  }
};

// scores[r, j0 : j0 + 16 * NV] for R rows: sum over d of q[r, d] * kt[d, j]
template <int R, int NV>
inline void score_tile(const float* q, const float* kt, float* s, int64_t D, int64_t kt_stride, int64_t s_stride) {
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    Vec k[NV];
    for (int c = 0; c < NV; ++c) k[c] = load16(kt + d * kt_stride + 16 * c);
    for (int r = 0; r < R; ++r) {
      const Vec qv = vset1(q[r * D + d]);
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(qv, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store16(s + r * s_stride + 16 * c, acc[r][c]);
}

// R rows' scores over keys [0, keys) (keys a multiple of 16). kt: the keys transposed in panels of KEY_TILE keys,
// [keys / KEY_TILE, D, KEY_TILE] (padded with zero keys): a tile reads one contiguous panel, where rows of one
// [D, keys] matrix would be a power-of-two stride apart (cache-set and TLB misses at long prompts).
template <int R>
inline void score_rows(const float* q, const float* kt, float* s, int64_t D, int64_t keys, int64_t s_stride) {
  int64_t j = 0;
  for (; j + KEY_TILE <= keys; j += KEY_TILE) score_tile<R, KV>(q, kt + j * D, s + j, D, KEY_TILE, s_stride);
  for (; j < keys; j += 16)
    score_tile<R, 1>(q, kt + j / KEY_TILE * KEY_TILE * D + j % KEY_TILE, s + j, D, KEY_TILE, s_stride);
}

// o[r, c0 : c0 + 16 * NV] = o[r, ...] * factor[r] + sum over keys j of p[r, j] * v[j, c] (o fp32, [R rows, D])
template <int R, int NV>
inline void value_tile(const float* p, const float* v, const float* factor, float* o, int64_t keys, int64_t D,
                       int64_t p_stride, int64_t c0) {
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = load16(o + r * D + c0 + 16 * c) * vset1(factor[r]);
  for (int64_t j = 0; j < keys; ++j) {
    Vec vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load16(v + j * D + c0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const Vec pv = vset1(p[r * p_stride + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(pv, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store16(o + r * D + c0 + 16 * c, acc[r][c]);
}

template <int R>
inline void value_rows(const float* p, const float* v, const float* factor, float* o, int64_t keys, int64_t D,
                       int64_t p_stride) {
  int64_t c = 0;
  for (; c + 16 * DV <= D; c += 16 * DV) value_tile<R, DV>(p, v, factor, o, keys, D, p_stride, c);
  for (; c < D; c += 16) value_tile<R, 1>(p, v, factor, o, keys, D, p_stride, c);
}

#if defined(__AVX512BF16__)
// bf16 inputs on AVX512_BF16: the products from bf16 pairs (vdpbf16ps: 32 multiply-adds an instruction, twice an
// fp32 FMA's), summed in fp32. Layouts (raw bf16 bits): q as stored (unscaled: the scale multiplies the fp32
// scores); the keys in panels [D / 2, KEY_TILE, 2] (a d pair of 16 keys per vector); the values [keys / 2, D, 2]
// (a key pair of 16 columns); the probabilities rounded to bf16 once (as torch's bf16 flash attention does).
inline __m512bh pair_of(const uint16_t* p) {  // the 2 bf16 at p in every 32-bit lane
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return (__m512bh)_mm512_set1_epi32(bits);
}

template <int R, int NV>
inline void score_tile_pairs(const uint16_t* q, const uint16_t* kt, float* s, int64_t D, int64_t s_stride,
                             float scale) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < D / 2; ++dp) {
    __m512bh k[NV];
    for (int c = 0; c < NV; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kt + dp * 2 * KEY_TILE + 32 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh qp = pair_of(q + r * D + 2 * dp);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], k[c], qp);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(s + r * s_stride + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(scale)));
}

template <int R>
inline void score_rows_pairs(const uint16_t* q, const uint16_t* kt, float* s, int64_t D, int64_t keys,
                             int64_t s_stride, float scale) {
  int64_t j = 0;
  for (; j + KEY_TILE <= keys; j += KEY_TILE) score_tile_pairs<R, KV>(q, kt + j * D, s + j, D, s_stride, scale);
  for (; j < keys; j += 16)
    score_tile_pairs<R, 1>(q, kt + j / KEY_TILE * KEY_TILE * D + j % KEY_TILE * 2, s + j, D, s_stride, scale);
}

template <int R, int NV>
inline void value_tile_pairs(const uint16_t* p, const uint16_t* v, const float* factor, float* o, int64_t keys,
                             int64_t D, int64_t p_stride, int64_t c0) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c0 + 16 * c), _mm512_set1_ps(factor[r]));
  for (int64_t j = 0; j < keys; j += 2) {
    __m512bh vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v + j * D + (c0 + 16 * c) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh pp = pair_of(p + r * p_stride + j);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], pp);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * D + c0 + 16 * c, acc[r][c]);
}

template <int R>
inline void value_rows_pairs(const uint16_t* p, const uint16_t* v, const float* factor, float* o, int64_t keys,
                             int64_t D, int64_t p_stride) {
  int64_t c = 0;
  for (; c + 16 * DV <= D; c += 16 * DV) value_tile_pairs<R, DV>(p, v, factor, o, keys, D, p_stride, c);
  for (; c < D; c += 16) value_tile_pairs<R, 1>(p, v, factor, o, keys, D, p_stride, c);
}
constexpr bool kPairs = true;
#else
constexpr bool kPairs = false;
#endif
#endif

struct Shape {
  int64_t seqs, new_tokens, ctx, heads, kv_heads, group, D;
  int64_t q_stride, k_stride, v_stride;  // elements between tokens
};

// Query positions per work item: ~64 rows (positions x the group's heads): enough items for the threads to share
// evenly, each row tile's queries and outputs [rows, head_dim] in L1 / L2.
inline int64_t block_positions(const Shape& sh) { return std::max<int64_t>(1, 64 / sh.group); }

#if defined(LLMOPT_VEC)
// Whether T's products come from bf16 pairs (score_tile_pairs) in this build.
template <typename T>
constexpr bool pairs_for = kPairs && std::is_same_v<T, at::BFloat16>;

// The keys [c0, c1) of one sequence and KV head into the chunk's key panels and values (zero keys up to a whole
// panel): fp32, or the raw bf16 pairs.
template <typename T>
void pack_chunk(const T* k, const T* v, const Shape& sh, int64_t s, int64_t h, int64_t chunk, Packed& pk) {
  const int64_t D = sh.D, c0 = chunk * KEY_CHUNK, c1 = std::min(sh.ctx, c0 + KEY_CHUNK);
  const int64_t padded = (c1 - c0 + KEY_TILE - 1) / KEY_TILE * KEY_TILE, base = pk.at(s, h, chunk, sh.kv_heads, D);
  for (int64_t jj = 0; jj < padded; ++jj) {
    const bool key = c0 + jj < c1;  // else a zero key of the last panel
    const T* ks = key ? k + (s * sh.ctx + c0 + jj) * sh.k_stride + h * D : nullptr;
    const T* vs = key ? v + (s * sh.ctx + c0 + jj) * sh.v_stride + h * D : nullptr;
    const int64_t panel = jj / KEY_TILE * KEY_TILE * D;
    if constexpr (pairs_for<T>) {
      uint16_t* kd = pk.kt16.data() + base + panel + jj % KEY_TILE * 2;  // + (d / 2) * 2 * KEY_TILE + d % 2
      uint16_t* vd = pk.v16.data() + base + jj / 2 * 2 * D + jj % 2;     // + 2 * d
      for (int64_t d = 0; d < D; ++d) {
        kd[d / 2 * 2 * KEY_TILE + d % 2] = key ? ks[d].x : 0;
        vd[2 * d] = key ? vs[d].x : 0;
      }
    } else {
      float* kd = pk.kt.data() + base + panel + jj % KEY_TILE;
      float* vd = pk.v.data() + base + jj * D;
      for (int64_t d = 0; d < D; ++d) {
        kd[d * KEY_TILE] = key ? to_float(ks[d]) : 0.f;
        vd[d] = key ? to_float(vs[d]) : 0.f;
      }
    }
  }
}

// Rows [r0, r0 + R) (their causal limits own[0..R)) over the packed chunk's keys [c0, c1): scores, then the
// running softmax per row (max, sum, and the factor by which its earlier output shrinks), then o += p . v.
template <int R, bool PAIRS>
void chunk_rows(int64_t r0, const int64_t* own, int64_t c0, int64_t c1, const Packed& pk, int64_t base, Buffers& b,
                int64_t D, float scale) {
  const int64_t keys = (std::min(own[R - 1], c1) - c0 + 15) / 16 * 16;  // the last row's, in whole vectors
  float* s = b.scores.data();
#if defined(__AVX512BF16__)
  if constexpr (PAIRS) score_rows_pairs<R>(b.q16.data() + r0 * D, pk.kt16.data() + base, s, D, keys, KEY_CHUNK, scale);
#endif
  if constexpr (!PAIRS) score_rows<R>(b.q.data() + r0 * D, pk.kt.data() + base, s, D, keys, KEY_CHUNK);
  for (int r = 0; r < R; ++r) {
    float* row = s + r * KEY_CHUNK;
    const int64_t n = std::min(own[r], c1) - c0;  // this row's keys in the chunk (> 0: rows before are skipped)
    float& max = b.max[r0 + r];
    const float chunk_max = std::max(max, attention::max_of(row, n));
    b.factor[r] = std::exp(max - chunk_max);  // (0 on the first chunk: max is -inf)
    b.sum[r0 + r] = b.sum[r0 + r] * b.factor[r] + attention::softmax_numerators(row, n, chunk_max);
    max = chunk_max;
    std::fill(row + n, row + keys, 0.f);  // keys past this row's limit
  }
  float* o = b.o.data() + r0 * D;
#if defined(__AVX512BF16__)
  if constexpr (PAIRS) {
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < keys; j += 16)
        store16(reinterpret_cast<at::BFloat16*>(b.p16.data()) + r * KEY_CHUNK + j, load16(s + r * KEY_CHUNK + j));
    value_rows_pairs<R>(b.p16.data(), pk.v16.data() + base, b.factor.data(), o, keys, D, KEY_CHUNK);
  }
#endif
  if constexpr (!PAIRS) value_rows<R>(s, pk.v.data() + base, b.factor.data(), o, keys, D, KEY_CHUNK);
}

// One item: sequence s, KV head h, query positions [i0, i1) of the sequence's new tokens.
template <typename T>
void attend_block(const T* q, const Packed& pk, T* out, const Shape& sh, float scale, int64_t s, int64_t h,
                  int64_t i0, int64_t i1, Buffers& b) {
  constexpr bool PAIRS = pairs_for<T>;
  const int64_t D = sh.D, G = sh.group, rows = (i1 - i0) * G;
  const int64_t offset = sh.ctx - sh.new_tokens;  // position of new token 0
  const int64_t keys = offset + i1;               // the last row's causal limit
  if constexpr (PAIRS) {
    b.q16.resize(rows * D);
    b.p16.resize(MR * KEY_CHUNK);
  } else {
    b.q.resize(rows * D);
  }
  b.scores.resize(MR * KEY_CHUNK);
  b.o.assign(rows * D, 0.f);
  b.max.assign(rows, -std::numeric_limits<float>::infinity());
  b.sum.assign(rows, 0.f);
  b.factor.resize(MR);
  // rows in (position, head of the group) order: the MR rows of a tile share one or two causal limits
  std::vector<int64_t> own(rows);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (i - i0) * G + g;
      const T* src = q + (s * sh.new_tokens + i) * sh.q_stride + (h * G + g) * D;
      if constexpr (PAIRS) {
        std::memcpy(b.q16.data() + r * D, src, D * sizeof(T));
      } else {
        for (int64_t d = 0; d < D; ++d) b.q[r * D + d] = to_float(src[d]) * scale;
      }
      own[r] = offset + i + 1;
    }
  for (int64_t c0 = 0; c0 < keys; c0 += KEY_CHUNK) {
    const int64_t c1 = std::min(keys, c0 + KEY_CHUNK), base = pk.at(s, h, c0 / KEY_CHUNK, sh.kv_heads, D);
    int64_t r0 = 0;
    while (r0 < rows && own[r0] <= c0) ++r0;  // rows whose keys all came before this chunk
    for (; r0 + MR <= rows; r0 += MR) chunk_rows<MR, PAIRS>(r0, own.data() + r0, c0, c1, pk, base, b, D, scale);
    for (; r0 < rows; ++r0) chunk_rows<1, PAIRS>(r0, own.data() + r0, c0, c1, pk, base, b, D, scale);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r / G, g = r % G;
    T* dst = out + (s * sh.new_tokens + i) * sh.heads * D + (h * G + g) * D;
    const Vec inv = vset1(1.f / b.sum[r]);
    for (int64_t d = 0; d < D; d += 16) store16(dst + d, load16(b.o.data() + r * D + d) * inv);
  }
}
#endif

at::Tensor causal_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    int64_t new_tokens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "q [S*new, H, D], k, v [S*ctx, KVH, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "q, k, v share a dtype");
  TORCH_CHECK(new_tokens > 0 && q.size(0) % new_tokens == 0, "q's rows: whole sequences of new_tokens");
  const int64_t seqs = q.size(0) / new_tokens;
  TORCH_CHECK(k.size(0) % seqs == 0 && k.size(0) / seqs >= new_tokens, "k's rows: S sequences of ctx >= new");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(2) % 16 == 0, "head_dim: equal in q and k, a multiple of 16");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads: a multiple of the KV heads");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "each token's heads must be contiguous");
  const Shape sh{seqs, new_tokens, k.size(0) / seqs, q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2),
                 q.stride(0), k.stride(0), v.stride(0)};
  at::Tensor out = at::empty({q.size(0), sh.heads, sh.D}, q.options());
#if defined(LLMOPT_VEC)
  const int64_t per = block_positions(sh), blocks = (new_tokens + per - 1) / per;
  // items: (block, sequence, KV head), latest blocks first (they cost the most), taken by the threads in turn
  const int64_t items = blocks * seqs * sh.kv_heads;
  std::atomic<int64_t> next{0};
  LLMOPT_DISPATCH(q, [&] {
    const auto* qp = q.data_ptr<scalar_t>();
    const auto* kp = k.data_ptr<scalar_t>();
    const auto* vp = v.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    static thread_local Packed calling_threads;
    Packed& pk = calling_threads;  // (a reference: the workers below see this thread's buffers, not their own)
    const int64_t chunks = (sh.ctx + KEY_CHUNK - 1) / KEY_CHUNK;
    pk.per_head = (sh.ctx + KEY_TILE - 1) / KEY_TILE * KEY_TILE * sh.D;
    const auto grow = [](auto& buffer, int64_t size) {
      if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    };
    if constexpr (pairs_for<scalar_t>) {
      grow(pk.kt16, seqs * sh.kv_heads * pk.per_head);
      grow(pk.v16, seqs * sh.kv_heads * pk.per_head);
    } else {
      grow(pk.kt, seqs * sh.kv_heads * pk.per_head);
      grow(pk.v, seqs * sh.kv_heads * pk.per_head);
    }
    at::parallel_for(0, seqs * sh.kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        pack_chunk(kp, vp, sh, t / (sh.kv_heads * chunks), t / chunks % sh.kv_heads, t % chunks, pk);
    });
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      Buffers buffers;
      for (int64_t item = next++; item < items; item = next++) {
        const int64_t block = blocks - 1 - item / (seqs * sh.kv_heads), rest = item % (seqs * sh.kv_heads);
        const int64_t i0 = block * per, i1 = std::min(new_tokens, i0 + per);
        attend_block<scalar_t>(qp, pk, op, sh, static_cast<float>(scale), rest / sh.kv_heads, rest % sh.kv_heads,
                               i0, i1, buffers);
      }
    });
  });
#else
  TORCH_CHECK(false, "causal_prefill_attention needs a vector build (AVX2 or AVX-512)");
#endif
  return out;
}

}  // namespace llmopt_cpu::prefill
