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
// Returns [S * new, num_heads, head_dim] in q's dtype. Per item, in fp32: the keys transposed (in panels) and
// the values [keys, head_dim] (converted once), the queries times the scale; scores = q . k for each row up to its
// limit (register tiles of MR rows by 16 * KV keys), an exact softmax per row (its max first: no rescaling), then
// out = p . v (tiles of MR rows by 16 * DV columns), divided by the row's sum once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
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

struct Buffers {
  std::vector<float> q, kt, v, scores, inv_sum;
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

// out[r, c0 : c0 + 16 * NV] = sum over keys j of p[r, j] * v[j, c], times inv_sum[r], in T
template <int R, int NV, typename T>
inline void value_tile(const float* p, const float* v, const float* inv_sum, T* const* out, int64_t keys, int64_t D,
                       int64_t p_stride, int64_t c0) {
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = vzero();
  for (int64_t j = 0; j < keys; ++j) {
    Vec vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load16(v + j * D + c0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const Vec pv = vset1(p[r * p_stride + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(pv, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store16(out[r] + c0 + 16 * c, acc[r][c] * vset1(inv_sum[r]));
}

template <int R, typename T>
inline void value_rows(const float* p, const float* v, const float* inv_sum, T* const* out, int64_t keys, int64_t D,
                       int64_t p_stride) {
  int64_t c = 0;
  for (; c + 16 * DV <= D; c += 16 * DV) value_tile<R, DV>(p, v, inv_sum, out, keys, D, p_stride, c);
  for (; c < D; c += 16) value_tile<R, 1>(p, v, inv_sum, out, keys, D, p_stride, c);
}
#endif

struct Shape {
  int64_t seqs, new_tokens, ctx, heads, kv_heads, group, D;
  int64_t q_stride, k_stride, v_stride;  // elements between tokens
};

// Query positions per work item: ~64 rows (positions x the group's heads) whose scores stay in L2.
inline int64_t block_positions(const Shape& sh) { return std::max<int64_t>(1, 64 / sh.group); }

#if defined(LLMOPT_VEC)
// One item: sequence s, KV head h, query positions [i0, i1) of the sequence's new tokens.
template <typename T>
void attend_block(const T* q, const T* k, const T* v, T* out, const Shape& sh, float scale, int64_t s, int64_t h,
                  int64_t i0, int64_t i1, Buffers& b) {
  const int64_t D = sh.D, G = sh.group, rows = (i1 - i0) * G;
  const int64_t offset = sh.ctx - sh.new_tokens;           // position of new token 0
  const int64_t keys = offset + i1;                        // the last row's causal limit
  const int64_t padded = (keys + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
  b.q.resize(rows * D);
  b.kt.assign(D * padded, 0.f);
  b.v.resize(keys * D);
  b.scores.resize(rows * padded);
  b.inv_sum.resize(rows);
  // rows in (position, head of the group) order: the MR rows of a tile share one or two causal limits
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + (s * sh.new_tokens + i) * sh.q_stride + (h * G + g) * D;
      float* dst = b.q.data() + ((i - i0) * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]) * scale;
    }
  for (int64_t j = 0; j < keys; ++j) {
    const T* ks = k + (s * sh.ctx + j) * sh.k_stride + h * D;
    const T* vs = v + (s * sh.ctx + j) * sh.v_stride + h * D;
    float* vd = b.v.data() + j * D;
    float* kd = b.kt.data() + j / KEY_TILE * KEY_TILE * D + j % KEY_TILE;
    for (int64_t d = 0; d < D; ++d) {
      kd[d * KEY_TILE] = to_float(ks[d]);
      vd[d] = to_float(vs[d]);
    }
  }
  for (int64_t r0 = 0; r0 < rows; r0 += MR) {
    const int64_t r1 = std::min(rows, r0 + MR);
    const int64_t limit = offset + i0 + (r1 - 1) / G + 1;  // keys the tile's last row attends
    const int64_t tile_keys = (limit + 15) / 16 * 16;
    float* s_rows = b.scores.data() + r0 * padded;
    const float* q_rows = b.q.data() + r0 * D;
    if (r1 - r0 == MR) {
      score_rows<MR>(q_rows, b.kt.data(), s_rows, D, tile_keys, padded);
    } else {
      for (int64_t r = r0; r < r1; ++r)
        score_rows<1>(q_rows + (r - r0) * D, b.kt.data(), s_rows + (r - r0) * padded, D, tile_keys, padded);
    }
    T* out_rows[MR];
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t own = offset + i0 + r / G + 1;  // this row's causal limit
      float* row = b.scores.data() + r * padded;
      const float sum = attention::softmax_numerators(row, own, attention::max_of(row, own));
      std::fill(row + own, row + limit, 0.f);  // the tile's later keys: not this row's
      b.inv_sum[r] = 1.f / sum;
      const int64_t i = i0 + r / G, g = r % G;
      out_rows[r - r0] = out + (s * sh.new_tokens + i) * sh.heads * D + (h * G + g) * D;
    }
    if (r1 - r0 == MR) {
      value_rows<MR>(s_rows, b.v.data(), b.inv_sum.data() + r0, out_rows, limit, D, padded);
    } else {
      for (int64_t r = r0; r < r1; ++r)
        value_rows<1>(s_rows + (r - r0) * padded, b.v.data(), b.inv_sum.data() + r, out_rows + (r - r0), limit, D,
                      padded);
    }
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
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      Buffers buffers;
      for (int64_t item = next++; item < items; item = next++) {
        const int64_t block = blocks - 1 - item / (seqs * sh.kv_heads), rest = item % (seqs * sh.kv_heads);
        const int64_t i0 = block * per, i1 = std::min(new_tokens, i0 + per);
        attend_block<scalar_t>(qp, kp, vp, op, sh, static_cast<float>(scale), rest / sh.kv_heads,
                               rest % sh.kv_heads, i0, i1, buffers);
      }
    });
  });
#else
  TORCH_CHECK(false, "causal_prefill_attention needs a vector build (AVX2 or AVX-512)");
#endif
  return out;
}

}  // namespace llmopt_cpu::prefill
