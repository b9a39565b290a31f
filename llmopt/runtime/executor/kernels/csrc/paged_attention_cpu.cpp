// Decode attention over the paged KV cache, read in place (CPU).
//
// The torch path gathers every sequence's KV blocks into a padded copy (index_select) and then runs SDPA over
// it: the cache is read twice and written once per layer, and at batch 64 that copy plus SDPA is ~40% of a
// decode step. This kernel reads each sequence's blocks where they lie, once for K and once for V.
//
// Shapes: q [B, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables [B, max_blocks] int64; context_lens [B] int64 (tokens in the cache, the new one included);
// returns [B, num_heads, head_dim] in q's dtype. GQA: query head j reads KV head j / (num_heads / num_kv_heads),
// as transformers' repeat_kv and SDPA's enable_gqa do.
//
// Per work item (a sequence, or one KV head of it when there are few sequences): scores [group, ctx] = q . k *
// scale in fp32 (first pass over K), a softmax per query head, then out = p . v accumulated in fp32 (second pass
// over V). Nothing is padded: each sequence reads exactly its context_len rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "work_queue.h"

namespace llmopt_cpu::attention {  // entry points declared in ops.h, registered in register.cpp

using namespace llmopt_cpu;

#if defined(LLMOPT_VEC)
constexpr bool kVectorized = true;
#else
constexpr bool kVectorized = false;
#endif

inline float max_of(const float* s, int64_t n) {
  float max = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(LLMOPT_VEC)
  Vec vbig = vset1(max);
  for (; i + 16 <= n; i += 16) vbig = vmax(vbig, load16(s + i));
  max = reduce_max(vbig);
#endif
  for (; i < n; ++i) max = std::max(max, s[i]);
  return max;
}

// exp(x - max) in place over n values; returns their sum.
inline float softmax_numerators(float* s, int64_t n, float max) {
  float sum = 0.f;
  int64_t i = 0;
#if defined(LLMOPT_VEC)
  Vec vsum = vzero();
  const Vec vbig = vset1(max);
  for (; i + 16 <= n; i += 16) {
    const Vec e = exp16(load16(s + i) - vbig);
    store16(s + i, e);
    vsum = vsum + e;
  }
  sum = reduce_add(vsum);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - max);
    sum += s[i];
  }
  return sum;
}


// Heads [h0, h1) of one sequence, every query head of the group reading each key/value row once. Rows of a
// block are contiguous over the KV heads ([block_size, num_kv_heads, head_dim]), so an item that takes all the
// heads of a sequence streams each block front to back in pass 1: on a cache read cold from memory (the usual case:
// 30 layers of KV do not stay in cache between steps) this is ~25% faster than one item per (sequence, head). Pass
// 1 also requests the value rows into L2, and pass 2 then reads them one KV head at a time.
// q_f [num_heads, head_dim] fp32 (the scale is applied to the scores); scores [group * (h1 - h0), ctx];
// out [num_heads, head_dim] fp32.
struct Item {
  const int64_t* table;
  int64_t ctx, h0, h1;
};

struct Layout {
  int64_t block_size, num_kv_heads, head_dim, group, block_stride, token_stride;
};

struct Range {  // tokens [begin, end) of the item's sequence
  int64_t begin, end;
};

// Softmax over each query head's scores [rows][n] in place; writes 1 / sum to inv_sum and, when lse is given,
// max + log(sum) per row.
inline void softmax_rows(float* scores, int64_t rows, int64_t n, float* inv_sum, float* lse) {
  for (int64_t j = 0; j < rows; ++j) {
    float* s = scores + j * n;
    const float max = max_of(s, n);
    const float sum = softmax_numerators(s, n, max);
    inv_sum[j] = 1.f / sum;
    if (lse) lse[j] = max + std::log(sum);
  }
}

// q [B, H, D] over a cache [blocks, block_size, KVH, D] (strides in elements of the cache)
inline Layout layout_of(const at::Tensor& q, const at::Tensor& cache) {
  const int64_t block_size = cache.size(1), kv_heads = cache.size(2), head_dim = cache.size(3);
  return {block_size, kv_heads, head_dim, q.size(1) / kv_heads, block_size * kv_heads * head_dim, kv_heads * head_dim};
}

#if defined(LLMOPT_VEC)
// Requests the rows of this item's next block (from token t0 + block_size on) into L1.
template <typename T>
inline void prefetch_next_block(const T* base, const Item& it, const Layout& L, int64_t t0) {
  const int64_t next = t0 + L.block_size;
  if (next >= it.ctx) return;
  const char* p = reinterpret_cast<const char*>(base + it.table[next / L.block_size] * L.block_stride);
  const int64_t bytes = std::min(L.block_size, it.ctx - next) * L.token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// Token t's row (all KV heads) in this item's cache; for the bf16 pass the 16 rows from t on are contiguous
// (block_size is a multiple of 16).
inline const at::BFloat16* row_of(const at::BFloat16* base, const Item& it, const Layout& L, int64_t t) {
  return base + it.table[t / L.block_size] * L.block_stride + (t % L.block_size) * L.token_stride;
}

#if defined(__AVX512F__)
// r[i] = sum of the 16 lanes of v[i], for 16 vectors (a transpose-and-add: 45 shuffles/adds instead of 16
// horizontal reductions of 8 each).
inline __m512 reduce16x16(__m512* v) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: partial sums of 4 consecutive vectors
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44), _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // lanes [t0 L0+L1, t0 L2+L3, t1 L0+L1, t1 L2+L3]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88), _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
}
#endif

// Requests heads [h0, h1) of one cache row (all KV heads of a token; `head` elements per head).
template <int HINT, typename T>  // _MM_HINT_T0 / _T1 / _T2 (an enum in gcc, an int in clang)
inline void prefetch_heads(const T* row, const Item& it, int64_t head) {
  const char* p = reinterpret_cast<const char*>(row + it.h0 * head);
  const int64_t bytes = (it.h1 - it.h0) * head * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, static_cast<decltype(_MM_HINT_T0)>(HINT));
}

// How far ahead pass 1 requests key and value rows into L2, in blocks (beside the next block's keys into L1). With
// the next block alone a thread read ~8 GB/s from memory (at ~100 ns a miss, ~12 lines in flight), where a
// sequential read streams ~15; requesting the block after it as well, keys and values, cut 14-36% of the time on a
// 2-core Zen 4 (benchmarks/kernels/decode_attention.py, 30 layers' caches from memory, two alternating runs: 64 sequences x
// 192 tokens fp16 16.5-17.1 -> 12.9-13.4 ms, 16 x 512 12.3-13.1 -> 7.9-8.8, 1 x 4,096 5.7-6.1 -> 4.4-4.6; fp32 and
// bf16 alike), 12-29% in the AVX2 build (under its simulation), 8-11% for an int8 cache (whose AVX-512 pass already
// requested the next block whole). 3 blocks ahead was no better, 4 and 6 worse.
constexpr int64_t KV_AHEAD_BLOCKS = 2;

// The rows from token t0 + KV_AHEAD_BLOCKS blocks that the passes request (t0 a whole block or 16-row group: its
// `rows` rows lie in one block): their element offset in the cache and how many lie before `end` (the block
// looked up once, not per row: a 64-bit division per row cost more than the requests saved). Both helpers are
// forced inline: called out of line once per row they took the 64 x 192-token step from ~12 to ~16 ms.
struct FarRows {
  int64_t offset, count;
};

__attribute__((always_inline)) inline FarRows far_rows(const Item& it, const Layout& L, int64_t t0, int64_t rows,
                                                      int64_t end) {
  const int64_t far = t0 + KV_AHEAD_BLOCKS * L.block_size;
  const int64_t count = std::max<int64_t>(0, std::min(rows, end - far));
  if (count == 0) return {0, 0};
  return {it.table[far / L.block_size] * L.block_stride + (far % L.block_size) * L.token_stride, count};
}

// Requests row i of `far`, keys and values, into L2 (`head` elements per KV head)
template <typename T>
__attribute__((always_inline)) inline void request_far_row(const T* k_ptr, const T* v_ptr, const FarRows& far,
                                                           int64_t i, const Item& it, const Layout& L, int64_t head) {
  if (i >= far.count) return;
  prefetch_heads<_MM_HINT_T1>(k_ptr + far.offset + i * L.token_stride, it, head);
  prefetch_heads<_MM_HINT_T1>(v_ptr + far.offset + i * L.token_stride, it, head);
}

// Pass 1 over tokens [begin, end) of an item (begin a multiple of the block size), any cache: one key row at a
// time, its chunks loaded once (load_chunk: 16 values of a float cache, or an 8-bit one's codes decoded) and reused
// by the group's query heads; scores [nh * G][end - begin] = q . k times row_factor(block, i, h) (the softmax scale,
// times the row's key scale for an 8-bit cache). Blocks lie anywhere in the cache, where the hardware prefetcher
// cannot follow: with key row i this requests row i of the next block (into L1), row i of this block's values
// (into L2, for pass 2) and row i of both KV_AHEAD_BLOCKS blocks on (into L2), a few lines per row. On a 2-core
// AVX2 EPYC both passes had stalled on the loads of each block's rows; with the first two requests and pass 2's
// accumulators in registers (value_pass), 64 sequences x 160 tokens x 30 layers from memory took 32-36 ms instead
// of 42-50 (fp32 cache) and 21-22 instead of 36-37 (fp16), alternating the two builds (ad-hoc script).
template <int G, int CH, typename T, typename LoadChunk, typename RowFactor>
void key_pass(const float* q_f, const T* k_ptr, const T* v_ptr, const Item& it, const Layout& L, int64_t begin,
              int64_t end, float* scores, LoadChunk load_chunk, RowFactor row_factor) {
  const int64_t n_all = end - begin;
  for (int64_t t0 = begin; t0 < end; t0 += L.block_size) {
    const int64_t block = it.table[t0 / L.block_size];
    const T* kb = k_ptr + block * L.block_stride;
    const T* vb = v_ptr + block * L.block_stride;
    const int64_t n = std::min(L.block_size, end - t0), next = t0 + L.block_size;
    const T* kn = next < end ? k_ptr + it.table[next / L.block_size] * L.block_stride : nullptr;
    const int64_t n_next = kn ? std::min(L.block_size, end - next) : 0;
    const FarRows far = far_rows(it, L, t0, L.block_size, end);
    for (int64_t i = 0; i < n; ++i) {
      request_far_row(k_ptr, v_ptr, far, i, it, L, CH * 16);
      if (i < n_next) prefetch_heads<_MM_HINT_T0>(kn + i * L.token_stride, it, CH * 16);
      prefetch_heads<_MM_HINT_T1>(vb + i * L.token_stride, it, CH * 16);
      for (int64_t h = it.h0; h < it.h1; ++h) {
        const T* krow = kb + i * L.token_stride + h * CH * 16;
        Vec kv[CH];
        for (int c = 0; c < CH; ++c) kv[c] = load_chunk(krow + c * 16);
        const float factor = row_factor(block, i, h);
        for (int g = 0; g < G; ++g) {
          const float* qg = q_f + (h * G + g) * CH * 16;
          Vec s = load16(qg) * kv[0];
          for (int c = 1; c < CH; ++c) s = vfma(load16(qg + c * 16), kv[c], s);
          scores[((h - it.h0) * G + g) * n_all + t0 - begin + i] = reduce_add(s) * factor;
        }
      }
    }
  }
}

// Pass 1 of a float cache over the item's tokens r
template <typename T, int G, int CH>
void scores_rows(const float* q_f, const T* k_ptr, const T* v_ptr, const Item& it, const Range& r, const Layout& L,
                 float scale, float* scores) {
  key_pass<G, CH>(q_f, k_ptr, v_ptr, it, L, r.begin, r.end, scores, [](const T* p) { return load16(p); },
                  [scale](int64_t, int64_t, int64_t) { return scale; });
}

#if defined(__AVX512BF16__)
// Pass 1 for bf16 caches (block_size a multiple of 16): 16 rows at a time, each row read whole and in memory
// order (all heads of a row are contiguous; reading head by head instead jumps across the block and was 14%
// slower cold), dot products straight from the stored bf16 pairs (vdpbf16ps, fp32 accumulation; q rounded to
// bf16, which it already is), the 16 partial vectors of each query head parked in L1 and reduced together.
// Blocks lie anywhere in the cache, where the hardware prefetcher cannot follow, so with each key row this
// requests the same row of the next 16 (into L1) and of this item's value rows (T2, for pass 2): spread
// over the loop, a few lines per row, this keeps the memory busy without the stalls of requesting a whole
// block at once, and took the kernel from ~9 to ~16 GB/s on a cold cache (the machine's streaming rate).
template <int G, int CH>
void scores_bf16(const float* q_f, const at::BFloat16* k_ptr, const at::BFloat16* v_ptr, const Item& it,
                 const Range& r, const Layout& L, float scale, float* scores) {
  const int64_t ctx = r.end, n_all = r.end - r.begin, nh = it.h1 - it.h0;  // (r.begin: a whole number of blocks)
  static thread_local std::vector<__m512bh> qb_buf;
  static thread_local std::vector<__m512> parts_buf;
  if (qb_buf.size() < static_cast<size_t>(nh * G * CH / 2)) qb_buf.resize(nh * G * CH / 2);
  if (parts_buf.size() < static_cast<size_t>(nh * G * 16)) parts_buf.resize(nh * G * 16);
  __m512bh* qb = qb_buf.data();  // [nh][G][CH / 2]
  __m512* parts = parts_buf.data();  // [nh * G][16 rows]
  for (int64_t h = 0; h < nh; ++h)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH / 2; ++c) {
        const float* qg = q_f + ((it.h0 + h) * G + g) * CH * 16 + c * 32;
        qb[(h * G + g) * (CH / 2) + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qg + 16), _mm512_loadu_ps(qg));
      }
  for (int64_t t0 = r.begin; t0 < ctx; t0 += 16) {
    const at::BFloat16* rows = k_ptr + it.table[t0 / L.block_size] * L.block_stride + (t0 % L.block_size) * L.token_stride;
    const int64_t n = std::min<int64_t>(16, ctx - t0);
    const int64_t next = t0 + 16;
    const at::BFloat16* k_next = next < ctx ? row_of(k_ptr, it, L, next) : nullptr;
    const at::BFloat16* v_this = row_of(v_ptr, it, L, t0);
    const FarRows far = far_rows(it, L, t0, 16, ctx);
    for (int i = 0; i < 16; ++i) {
      request_far_row(k_ptr, v_ptr, far, i, it, L, CH * 16);
      if (next + i < ctx) prefetch_heads<_MM_HINT_T0>(k_next + i * L.token_stride, it, CH * 16);
      if (i < n) prefetch_heads<_MM_HINT_T2>(v_this + i * L.token_stride, it, CH * 16);
      const at::BFloat16* row = rows + i * L.token_stride + it.h0 * CH * 16;
      for (int64_t h = 0; h < nh; ++h) {
        __m512bh kv[CH / 2];
        if (i < n)
          for (int c = 0; c < CH / 2; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(row + h * CH * 16 + c * 32);
        for (int g = 0; g < G; ++g) {
          __m512 acc = _mm512_setzero_ps();
          if (i < n)
            for (int c = 0; c < CH / 2; ++c) acc = _mm512_dpbf16_ps(acc, qb[(h * G + g) * (CH / 2) + c], kv[c]);
          parts[(h * G + g) * 16 + i] = acc;
        }
      }
    }
    for (int64_t j = 0; j < nh * G; ++j) {
      const __m512 sums = _mm512_mul_ps(reduce16x16(parts + j * 16), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + j * n_all + t0 - r.begin, (__mmask16)((1u << n) - 1), sums);
    }
  }
}
#endif

// Value chunks (16 lanes each) one pass of pass 2 keeps for all G query heads: the largest divisor of CH whose
// G x CW accumulators stay in registers beside the row (AVX2: 16 ymm registers, a Vec takes two; AVX-512: 32).
constexpr int value_chunks(int G, int CH) {
#if defined(__AVX512F__)
  const int budget = 24;
#else
  const int budget = 6;
#endif
  for (int cw = CH; cw > 1; --cw)
    if (CH % cw == 0 && G * cw <= budget) return cw;
  return 1;
}

// Pass 2's step for one value row vv (CH chunks) of a KV head: a[g] += (p[g * stride] * factor) * vv for its G
// query heads (factor: an 8-bit row's value scale, 1 otherwise).
template <int G, int CH>
inline void accumulate_row(Vec (&a)[G][CH], const Vec (&vv)[CH], const float* p, int64_t stride, float factor) {
  for (int g = 0; g < G; ++g) {
    const Vec pg = vset1(p[g * stride] * factor);
    for (int c = 0; c < CH; ++c) a[g][c] = vfma(pg, vv[c], a[g][c]);
  }
}

// Pass 2 over tokens [begin, end) of an item (begin a multiple of the block size), scores [nh * G][end - begin]
// holding the softmax numerators: per KV head and run of CW value chunks, every token's value row with the
// accumulators in registers (pass 1 requested the rows into L2), each output's products summed in token order;
// then times each query head's 1 / sum into out [num_heads, head_dim]. load_chunk(p) reads 16 values of the cache
// (a float one's, or an 8-bit one's codes); row_factor(block, i, h) is a row's value scale (1 for a float cache).
template <int G, int CH, typename T, typename LoadChunk, typename RowFactor>
void value_pass(const T* v_ptr, const float* scores, const float* inv_sum, const Item& it, const Layout& L,
                int64_t begin, int64_t end, float* out, LoadChunk load_chunk, RowFactor row_factor) {
  constexpr int CW = value_chunks(G, CH);
  const int64_t n_all = end - begin;
  for (int64_t h = it.h0; h < it.h1; ++h) {
    const float* p = scores + (h - it.h0) * G * n_all;
    for (int c0 = 0; c0 < CH; c0 += CW) {
      Vec a[G][CW];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CW; ++c) a[g][c] = vzero();
      for (int64_t t0 = begin; t0 < end; t0 += L.block_size) {
        const int64_t block = it.table[t0 / L.block_size], n = std::min(L.block_size, end - t0);
        const T* vb = v_ptr + block * L.block_stride + (h * CH + c0) * 16;
        for (int64_t i = 0; i < n; ++i) {
          Vec vv[CW];
          for (int c = 0; c < CW; ++c) vv[c] = load_chunk(vb + i * L.token_stride + c * 16);
          accumulate_row<G, CW>(a, vv, p + t0 - begin + i, n_all, row_factor(block, i, h));
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CW; ++c)
          store16(out + (h * G + g) * CH * 16 + (c0 + c) * 16, a[g][c] * vset1(inv_sum[(h - it.h0) * G + g]));
    }
  }
}

// G = group size and CH = head_dim / 16 known at compile time: key/value chunks and the output accumulators
// stay in registers.
// Tokens r of the item; lse (when the context is split): each query head's max + log(sum) for the merge.
template <typename T, int G, int CH>
void attend_heads(const float* q_f, const T* k_ptr, const T* v_ptr, const Item& it, const Range& r, const Layout& L,
                  float scale, float* scores, float* out, float* lse) {
  const int64_t nh = it.h1 - it.h0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16> && CH % 2 == 0) {
    if (L.block_size % 16 == 0) scores_bf16<G, CH>(q_f, k_ptr, v_ptr, it, r, L, scale, scores);
    else scores_rows<T, G, CH>(q_f, k_ptr, v_ptr, it, r, L, scale, scores);
  } else {
    scores_rows<T, G, CH>(q_f, k_ptr, v_ptr, it, r, L, scale, scores);
  }
#else
  scores_rows<T, G, CH>(q_f, k_ptr, v_ptr, it, r, L, scale, scores);
#endif
  float inv_sum[8 * 64];  // G <= 8 query heads per KV head, at most 64 KV heads
  softmax_rows(scores, nh * G, r.end - r.begin, inv_sum, lse);
  value_pass<G, CH>(v_ptr, scores, inv_sum, it, L, r.begin, r.end, out, [](const T* p) { return load16(p); },
                    [](int64_t, int64_t, int64_t) { return 1.0f; });
}
#endif

// Any shape, any build: the same two passes in scalar code.
template <typename T>
void attend_heads_generic(const float* q_f, const T* k_ptr, const T* v_ptr, const Item& it, const Range& r,
                          const Layout& L, float scale, float* scores, float* out, float* lse) {
  const int64_t ctx = r.end - r.begin, G = L.group, D = L.head_dim, nh = it.h1 - it.h0;
  for (int64_t t = r.begin; t < r.end; ++t) {
    const T* krow = k_ptr + it.table[t / L.block_size] * L.block_stride + (t % L.block_size) * L.token_stride;
    for (int64_t h = it.h0; h < it.h1; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q_f + (h * G + g) * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qg[d] * to_float(krow[h * D + d]);
        scores[((h - it.h0) * G + g) * ctx + t - r.begin] = s * scale;
      }
  }
  std::vector<float> inv_sum(nh * G);
  softmax_rows(scores, nh * G, ctx, inv_sum.data(), lse);
  float* acc = out + it.h0 * G * D;
  std::fill(acc, acc + nh * G * D, 0.f);
  for (int64_t t = r.begin; t < r.end; ++t) {
    const T* vrow = v_ptr + it.table[t / L.block_size] * L.block_stride + (t % L.block_size) * L.token_stride;
    for (int64_t h = it.h0; h < it.h1; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = (h - it.h0) * G + g;
        const float p = scores[j * ctx + t - r.begin];
        for (int64_t d = 0; d < D; ++d) acc[j * D + d] += p * to_float(vrow[h * D + d]);
      }
  }
  for (int64_t j = 0; j < nh * G; ++j)
    for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= inv_sum[j];
}

template <typename T>
using AttendFn = void (*)(const float*, const T*, const T*, const Item&, const Range&, const Layout&, float, float*,
                          float*, float*);

#if defined(LLMOPT_VEC)
template <typename T, int CH>
AttendFn<T> pick_group(int64_t group) {
  switch (group) {
    case 1: return attend_heads<T, 1, CH>;
    case 2: return attend_heads<T, 2, CH>;
    case 3: return attend_heads<T, 3, CH>;
    case 4: return attend_heads<T, 4, CH>;
    case 5: return attend_heads<T, 5, CH>;
    case 6: return attend_heads<T, 6, CH>;
    case 7: return attend_heads<T, 7, CH>;
    case 8: return attend_heads<T, 8, CH>;
    default: return attend_heads_generic<T>;
  }
}
#endif

template <typename T>
AttendFn<T> pick_attend(const Layout& L) {
#if defined(LLMOPT_VEC)
  if (L.num_kv_heads <= 64) {
    if (L.head_dim == 32) return pick_group<T, 2>(L.group);
    if (L.head_dim == 64) return pick_group<T, 4>(L.group);
    if (L.head_dim == 128) return pick_group<T, 8>(L.group);
  }
#endif
  return attend_heads_generic<T>;
}

constexpr int64_t kMinSplitTokens = 1024;  // a context shorter than this is never split

// Splits of each of `items` items' context: enough for ~4 items per thread, each split at least kMinSplitTokens
// long.
inline int64_t context_splits(int64_t items, int64_t max_ctx, int64_t threads) {
  const int64_t wanted = (4 * threads + items - 1) / items;
  return std::max<int64_t>(1, std::min(wanted, max_ctx / kMinSplitTokens));
}

// How a decode call's work is cut into items: whole sequences per item when there are enough to keep every thread
// busy; else, at long contexts, splits of each sequence's context with all KV heads (each item streams whole cache
// rows, where one KV head per item reads a third of every row: SmolLM2 at 8,128 tokens, bf16 cache, 2-core Zen 4,
// 30 layers of a batch-1 step 13.8 ms with a head per item unsplit, 12.3 split, 8.6 split with whole rows);
// else one KV head per item.
struct WorkSplit {
  int64_t heads_per_item, splits;
};

inline WorkSplit work_split(int64_t num_seqs, int64_t num_kv_heads, int64_t max_ctx, int64_t threads) {
  if (num_seqs == 0 || num_seqs >= 2 * threads) return {num_kv_heads, 1};
  int64_t splits = context_splits(num_seqs, max_ctx, threads);
  if (splits > threads) splits -= splits % threads;  // whole rounds of the threads
  return splits > 1 ? WorkSplit{num_kv_heads, splits} : WorkSplit{1, 1};
}

// The splits' outputs merged (as flash-decoding does): per sequence and query head, out = sum over splits of
// exp(lse_s - max) x out_s, over the sum of those weights. part_out [seq][split][H * D] (each split's normalized
// output), part_lse [seq][split][H] (-inf: a split beyond the sequence's context).
template <typename T>
void merge_splits(const std::vector<float>& part_out, const std::vector<float>& part_lse, int64_t num_seqs,
                  int64_t splits, int64_t num_heads, int64_t head_dim, T* out_ptr) {
  at::parallel_for(0, num_seqs * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_dim);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t seq = idx / num_heads, head = idx % num_heads;
      float max = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) max = std::max(max, part_lse[(seq * splits + s) * num_heads + head]);
      float total = 0.f;
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t s = 0; s < splits; ++s) {
        const float w = std::exp(part_lse[(seq * splits + s) * num_heads + head] - max);
        if (w == 0.f) continue;
        total += w;
        const float* o = part_out.data() + ((seq * splits + s) * num_heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += w * o[d];
      }
      T* os = out_ptr + (seq * num_heads + head) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) os[d] = static_cast<T>(merged[d] / total);
    }
  });
}

// The items of a decode call (work_split) over the threads: each item's queries in fp32, then attend(q_f, it, r,
// scores, dst, lse) over its tokens r into an fp32 [H * D] buffer, then the item's heads rounded into out (TQ) or,
// with splits, the merge. q [B, H, D]: a view whose heads may be strided (the fused q/k/v rows).
template <typename TQ, typename Attend>
void decode_items(const at::Tensor& q, const Layout& L, const at::Tensor& block_tables, const at::Tensor& context_lens,
                  at::Tensor& out, Attend attend) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = L.num_kv_heads, block_size = L.block_size, max_blocks = block_tables.size(1);
  const TQ* q_ptr = q.data_ptr<TQ>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  TQ* out_ptr = out.data_ptr<TQ>();
  const int64_t max_ctx = num_seqs ? *std::max_element(lens, lens + num_seqs) : 0;
  const WorkSplit work = work_split(num_seqs, num_kv_heads, max_ctx, at::get_num_threads());
  const int64_t heads_per_item = work.heads_per_item, splits = work.splits;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  // each split's tokens: a whole number of blocks
  const int64_t split_len = ((max_ctx + splits - 1) / splits + block_size - 1) / block_size * block_size;
  // with splits: each split's normalized output [seq][split][H * D] and log-sum-exp [seq][split][H]
  std::vector<float> part_out(splits > 1 ? num_seqs * splits * num_heads * head_dim : 0);
  std::vector<float> part_lse(splits > 1 ? num_seqs * splits * num_heads : 0);
  // (items differ in length with their sequences' contexts: whichever thread is free takes the next chunk)
  parallel_chunks(num_seqs * items_per_seq * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_f(num_heads * head_dim), acc(num_heads * head_dim), scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t split = idx % splits, item = idx / splits;
      const int64_t seq = item / items_per_seq, h0 = (item % items_per_seq) * heads_per_item;
      const Item it{tables + seq * max_blocks, lens[seq], h0, h0 + heads_per_item};
      TORCH_CHECK(it.ctx >= 1 && it.ctx <= max_blocks * block_size, "context length outside its block table");
      const Range r{std::min(split * split_len, it.ctx), std::min((split + 1) * split_len, it.ctx)};
      const int64_t first = h0 * L.group * head_dim, count = heads_per_item * L.group * head_dim;
      float* lse = splits > 1 ? part_lse.data() + (seq * splits + split) * num_heads + h0 * L.group : nullptr;
      float* dst = splits > 1 ? part_out.data() + (seq * splits + split) * num_heads * head_dim : acc.data();
      if (r.begin == r.end) {  // a split beyond this sequence's context
        for (int64_t j = 0; j < heads_per_item * L.group; ++j) lse[j] = -std::numeric_limits<float>::infinity();
        std::fill(dst + first, dst + first + count, 0.f);
        continue;
      }
      for (int64_t head = first / head_dim; head < (first + count) / head_dim; ++head) {
        const TQ* qh = q_ptr + seq * q.stride(0) + head * q.stride(1);
        for (int64_t d = 0; d < head_dim; ++d) q_f[head * head_dim + d] = to_float(qh[d]);
      }
      scores.resize(heads_per_item * L.group * (r.end - r.begin));
      attend(q_f.data(), it, r, scores.data(), dst, lse);
      if (splits == 1) {
        TQ* os = out_ptr + seq * num_heads * head_dim;
        for (int64_t j = first; j < first + count; ++j) os[j] = static_cast<TQ>(acc[j]);
      }
    }
  });
  if (splits > 1) merge_splits(part_out, part_lse, num_seqs, splits, num_heads, head_dim, out_ptr);
}

// TQ: q's and the output's dtype, T: the caches' (an fp32 model's fp16 / bf16 cache: TQ float)
template <typename TQ, typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                           at::Tensor& out) {
  const Layout L = layout_of(q, k_cache);
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const AttendFn<T> attend = pick_attend<T>(L);
  decode_items<TQ>(q, L, block_tables, context_lens, out,
                   [&](const float* q_f, const Item& it, const Range& r, float* scores, float* dst, float* lse) {
                     attend(q_f, k_ptr, v_ptr, it, r, L, fscale, scores, dst, lse);
                   });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [B, H, D] and caches [blocks, block_size, kv_heads, D] expected");
  const bool cache16 = k_cache.scalar_type() == at::kHalf || k_cache.scalar_type() == at::kBFloat16;
  const bool mixed = q.scalar_type() == at::kFloat && cache16;
  // bf16 queries over an fp16 cache (or fp16 over bf16: a model computing in one 16-bit type, a cache in the
  // other, as llama.cpp's default f16 cache beside a bf16 model): the queries read in fp32 (exact), the output
  // rounded once to q's dtype
  if (cache16 && q.scalar_type() != k_cache.scalar_type() &&
      (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16))
    return paged_decode_attention(q.to(at::kFloat), k_cache, v_cache, block_tables, context_lens, scale)
        .to(q.scalar_type());
  TORCH_CHECK((q.scalar_type() == k_cache.scalar_type() || mixed) && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype (or q fp32 / fp16 / bf16 over fp16 / bf16 caches)");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "head counts or sizes disagree");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one row per sequence");
  // q may be a view into the fused q/k/v projection's rows (the decoder's case): only its heads need to be
  // contiguous within a row
  const at::Tensor qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  const at::Tensor kc = k_cache.contiguous(), vc = v_cache.contiguous();
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  if (!mixed) {
    LLMOPT_DISPATCH(qc, [&] { decode_attention_impl<scalar_t, scalar_t>(qc, kc, vc, tables, lens, scale, out); });
  } else if (kc.scalar_type() == at::kHalf) {
    decode_attention_impl<float, at::Half>(qc, kc, vc, tables, lens, scale, out);
  } else {
    decode_attention_impl<float, at::BFloat16>(qc, kc, vc, tables, lens, scale, out);
  }
  return out;
}

// ---- 8-bit caches (kernels/kv_quant.py) -------------------------------------------------------------------
// Codes [num_blocks, block_size, num_kv_heads, head_dim] as bytes (int8, or E4M3 when FP8) with one fp32 scale
// per token and KV head [num_blocks, block_size, num_kv_heads]. The scales factor out of each vector's dot
// product and each value row, so codes are decoded in registers and nothing full-precision is written:
// score = (q . codes_k) * k_scale * scale; out += (p * v_scale) * codes_v.
//
// A work item covers tokens [begin, end) of one sequence's context (begin a multiple of the block size): the
// whole context, or with few sequences (a long prompt decoding alone: 1 sequence x 3 KV heads on 2 threads would
// leave a thread idle a third of the time) one split of it; each split writes its softmax-normalized output and
// its log-sum-exp per query head, and the splits are merged by those (as flash-decoding does).

template <bool FP8>
inline float code_value(uint8_t code) {
  if constexpr (FP8) return e4m3_to_float(code);
  else return static_cast<float>(static_cast<int8_t>(code));
}

struct Scales {
  const float* k;
  const float* v;
};

// Any shape, any build: the two passes in scalar code. out: [num_heads, head_dim] (this item's heads written).
template <bool FP8>
void attend_heads_q8_generic(const float* q_f, const uint8_t* k_ptr, const uint8_t* v_ptr, const Scales& S,
                             const Item& it, const Range& r, const Layout& L, float scale, float* scores, float* out,
                             float* lse) {
  const int64_t n = r.end - r.begin, G = L.group, D = L.head_dim, nh = it.h1 - it.h0, KVH = L.num_kv_heads;
  auto scale_at = [&](const float* base, int64_t t, int64_t h) {
    return base[(it.table[t / L.block_size] * L.block_size + t % L.block_size) * KVH + h];
  };
  for (int64_t t = r.begin; t < r.end; ++t) {
    const uint8_t* krow = k_ptr + it.table[t / L.block_size] * L.block_stride + (t % L.block_size) * L.token_stride;
    for (int64_t h = it.h0; h < it.h1; ++h) {
      const float ks = scale_at(S.k, t, h) * scale;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q_f + (h * G + g) * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qg[d] * code_value<FP8>(krow[h * D + d]);
        scores[((h - it.h0) * G + g) * n + t - r.begin] = s * ks;
      }
    }
  }
  std::vector<float> inv_sum(nh * G);
  softmax_rows(scores, nh * G, n, inv_sum.data(), lse);
  float* acc = out + it.h0 * G * D;
  std::fill(acc, acc + nh * G * D, 0.f);
  for (int64_t t = r.begin; t < r.end; ++t) {
    const uint8_t* vrow = v_ptr + it.table[t / L.block_size] * L.block_stride + (t % L.block_size) * L.token_stride;
    for (int64_t h = it.h0; h < it.h1; ++h) {
      const float vs = scale_at(S.v, t, h);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = (h - it.h0) * G + g;
        const float p = scores[j * n + t - r.begin] * vs;
        for (int64_t d = 0; d < D; ++d) acc[j * D + d] += p * code_value<FP8>(vrow[h * D + d]);
      }
    }
  }
  for (int64_t j = 0; j < nh * G; ++j)
    for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= inv_sum[j];
}

#if defined(LLMOPT_VEC)
template <bool FP8>
inline Vec load_codes16(const uint8_t* p) {
  if constexpr (FP8) return load16_e4m3(p);
  else return load16_i8(reinterpret_cast<const int8_t*>(p));
}

#if defined(__AVX512F__)
// Pass 1 on AVX-512 (block_size a multiple of 16): 16 key rows at a time, each query head's 16 partial vectors
// parked and reduced together (reduce16x16) instead of one horizontal sum per score; the 16 scores are then
// scaled by their rows' key scales in one multiply.
template <bool FP8, int G, int CH>
void scores_q8_16rows(const float* q_f, const uint8_t* k_ptr, const uint8_t* v_ptr, const Scales& S, const Item& it,
                      const Range& r, const Layout& L, float scale, float* scores) {
  const int64_t n_all = r.end - r.begin, nh = it.h1 - it.h0, KVH = L.num_kv_heads;
  static thread_local std::vector<__m512> parts_buf;
  if (parts_buf.size() < static_cast<size_t>(nh * G * 16)) parts_buf.resize(nh * G * 16);
  __m512* parts = parts_buf.data();  // [nh * G][16 rows]
  const __m512i row_idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(KVH)));
  for (int64_t t0 = r.begin; t0 < r.end; t0 += 16) {
    const int64_t block = it.table[t0 / L.block_size], in_block = t0 % L.block_size;
    if (in_block == 0) prefetch_next_block(k_ptr, it, L, t0);
    const uint8_t* rows = k_ptr + block * L.block_stride + in_block * L.token_stride;
    const uint8_t* value_rows = v_ptr + block * L.block_stride + in_block * L.token_stride;
    const float* row_scales = S.k + (block * L.block_size + in_block) * KVH;
    const int64_t n = std::min<int64_t>(16, r.end - t0);
    const FarRows far = far_rows(it, L, t0, 16, r.end);
    for (int64_t i = 0; i < 16; ++i) {
      request_far_row(k_ptr, v_ptr, far, i, it, L, CH * 16);
      if (i < n) prefetch_heads<_MM_HINT_T1>(value_rows + i * L.token_stride, it, CH * 16);  // for pass 2
      for (int64_t h = 0; h < nh; ++h) {
        Vec kv[CH];
        if (i < n)
          for (int c = 0; c < CH; ++c)
            kv[c] = load_codes16<FP8>(rows + i * L.token_stride + (it.h0 + h) * CH * 16 + c * 16);
        for (int g = 0; g < G; ++g) {
          __m512 acc = _mm512_setzero_ps();
          if (i < n) {
            const float* qg = q_f + ((it.h0 + h) * G + g) * CH * 16;
            for (int c = 0; c < CH; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c * 16), kv[c].v, acc);
          }
          parts[(h * G + g) * 16 + i] = acc;
        }
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t h = 0; h < nh; ++h) {
      // the 16 rows' key scales of this head (stride KVH), times the softmax scale
      const __m512 ks = _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, row_idx,
                                                               row_scales + it.h0 + h, 4), _mm512_set1_ps(scale));
      for (int g = 0; g < G; ++g) {
        const int64_t j = h * G + g;
        _mm512_mask_storeu_ps(scores + j * n_all + t0 - r.begin, valid,
                              _mm512_mul_ps(reduce16x16(parts + j * 16), ks));
      }
    }
  }
}
#endif

// G query heads per KV head and CH = head_dim / 16 known at compile time (as attend_heads).
template <bool FP8, int G, int CH>
void attend_heads_q8(const float* q_f, const uint8_t* k_ptr, const uint8_t* v_ptr, const Scales& S, const Item& it,
                     const Range& r, const Layout& L, float scale, float* scores, float* out, float* lse) {
  const int64_t n_all = r.end - r.begin, nh = it.h1 - it.h0, KVH = L.num_kv_heads, scale_block = L.block_size * KVH;
#if defined(__AVX512F__)
  if (L.block_size % 16 == 0) {
    scores_q8_16rows<FP8, G, CH>(q_f, k_ptr, v_ptr, S, it, r, L, scale, scores);
  } else
#endif
  {
    key_pass<G, CH>(q_f, k_ptr, v_ptr, it, L, r.begin, r.end, scores,
                    [](const uint8_t* p) { return load_codes16<FP8>(p); },
                    [&](int64_t block, int64_t i, int64_t h) { return S.k[block * scale_block + i * KVH + h] * scale; });
  }
  float inv_sum[8 * 64];
  softmax_rows(scores, nh * G, n_all, inv_sum, lse);
  // pass 2 as attend_heads' (value_pass): on a 2-core AVX2 EPYC, int8 cache from memory, 30 layers (ad-hoc script,
  // builds alternating), 64 seqs x 160 tokens 40-50 -> 22-33 ms, 8 x 512 15.5-16.9 -> 7.8-8.3 ms, 1 x 4096 (split)
  // 17.1-20.5 -> 8.5-12.8 ms against the per-block loop it replaced (accumulators copied through a buffer, whole
  // blocks requested at once), with the same products summed in the same order
  value_pass<G, CH>(v_ptr, scores, inv_sum, it, L, r.begin, r.end, out,
                    [](const uint8_t* p) { return load_codes16<FP8>(p); },
                    [&](int64_t block, int64_t i, int64_t h) { return S.v[block * scale_block + i * KVH + h]; });
}
#endif

using AttendQ8Fn = void (*)(const float*, const uint8_t*, const uint8_t*, const Scales&, const Item&, const Range&,
                            const Layout&, float, float*, float*, float*);

template <bool FP8>
AttendQ8Fn pick_attend_q8(const Layout& L) {
#if defined(LLMOPT_VEC)
  if (L.num_kv_heads <= 64 && L.group <= 8) {
    constexpr AttendQ8Fn by_group_64[8] = {attend_heads_q8<FP8, 1, 4>, attend_heads_q8<FP8, 2, 4>,
                                           attend_heads_q8<FP8, 3, 4>, attend_heads_q8<FP8, 4, 4>,
                                           attend_heads_q8<FP8, 5, 4>, attend_heads_q8<FP8, 6, 4>,
                                           attend_heads_q8<FP8, 7, 4>, attend_heads_q8<FP8, 8, 4>};
    constexpr AttendQ8Fn by_group_128[8] = {attend_heads_q8<FP8, 1, 8>, attend_heads_q8<FP8, 2, 8>,
                                            attend_heads_q8<FP8, 3, 8>, attend_heads_q8<FP8, 4, 8>,
                                            attend_heads_q8<FP8, 5, 8>, attend_heads_q8<FP8, 6, 8>,
                                            attend_heads_q8<FP8, 7, 8>, attend_heads_q8<FP8, 8, 8>};
    if (L.head_dim == 64) return by_group_64[L.group - 1];
    if (L.head_dim == 128) return by_group_128[L.group - 1];
  }
#endif
  return attend_heads_q8_generic<FP8>;
}

template <typename T>
void decode_attention_q8_impl(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& v_codes,
                              const at::Tensor& k_scales, const at::Tensor& v_scales, const at::Tensor& block_tables,
                              const at::Tensor& context_lens, double scale, bool fp8, at::Tensor& out) {
  const Layout L = layout_of(q, k_codes);
  const uint8_t* k_ptr = k_codes.data_ptr<uint8_t>();
  const uint8_t* v_ptr = v_codes.data_ptr<uint8_t>();
  const Scales S{k_scales.data_ptr<float>(), v_scales.data_ptr<float>()};
  const float fscale = static_cast<float>(scale);
  const AttendQ8Fn attend = fp8 ? pick_attend_q8<true>(L) : pick_attend_q8<false>(L);
  decode_items<T>(q, L, block_tables, context_lens, out,
                  [&](const float* q_f, const Item& it, const Range& r, float* scores, float* dst, float* lse) {
                    attend(q_f, k_ptr, v_ptr, S, it, r, L, fscale, scores, dst, lse);
                  });
}

at::Tensor paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& v_codes,
                                            const at::Tensor& k_scales, const at::Tensor& v_scales,
                                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                                            double scale, bool fp8) {
  TORCH_CHECK(q.dim() == 3 && k_codes.dim() == 4 && v_codes.sizes() == k_codes.sizes(),
              "q [B, H, D] and codes [blocks, block_size, kv_heads, D] expected");
  TORCH_CHECK(k_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte,
              "the codes are passed as uint8 (a view of the int8 or float8 cache)");
  TORCH_CHECK(k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat &&
                  k_scales.sizes() == v_scales.sizes() && k_scales.dim() == 3 && k_scales.size(0) == k_codes.size(0) &&
                  k_scales.size(1) == k_codes.size(1) && k_scales.size(2) == k_codes.size(2),
              "fp32 scales [blocks, block_size, kv_heads] expected");
  TORCH_CHECK(q.size(2) == k_codes.size(3) && q.size(1) % k_codes.size(2) == 0, "head counts or sizes disagree");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one row per sequence");
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor kc = k_codes.contiguous(), vc = v_codes.contiguous();
  const at::Tensor ksc = k_scales.contiguous(), vsc = v_scales.contiguous();
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  at::Tensor out = at::empty(qc.sizes(), qc.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.size(0) == 0) return out;
  LLMOPT_DISPATCH(qc, [&] {
    decode_attention_q8_impl<scalar_t>(qc, kc, vc, ksc, vsc, tables, lens, scale, fp8, out);
  });
  return out;
}

// k, v [T, kv_heads, head_dim] (each token's row contiguous) -> their codes and scales in slot_mapping's slots:
// the same numbers as kv_quant.quantize_kv (amax / code_max in fp32, x / scale in fp32, clamped, rounded half to
// even; E4M3 through c10's conversion, which torch's cast uses).
template <typename T, bool FP8>
void store_quantized_rows(const T* x, int64_t x_stride, uint8_t* codes, float* scales, const int64_t* slots,
                          int64_t num_tokens, int64_t kvh, int64_t hd) {
  const float code_max = FP8 ? 448.f : 127.f;
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t h = 0; h < kvh; ++h) {
      const T* row = x + t * x_stride + h * hd;
      const float s = row_amax(row, hd) / code_max, safe = s > 0.f ? s : 1.f;
      uint8_t* out = codes + (slots[t] * kvh + h) * hd;
      if constexpr (FP8) {
        for (int64_t d = 0; d < hd; ++d)
          out[d] = c10::Float8_e4m3fn(std::min(std::max(to_float(row[d]) / safe, -code_max), code_max)).x;
      } else {
        quantize_row_int8(row, hd, safe, -code_max, code_max, reinterpret_cast<int8_t*>(out));
      }
      scales[slots[t] * kvh + h] = s;
    }
}

void store_kv_quantized_(at::Tensor& k_codes, at::Tensor& v_codes, at::Tensor& k_scales, at::Tensor& v_scales,
                         const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_codes.is_contiguous() && v_codes.is_contiguous() && k_codes.sizes() == v_codes.sizes() &&
                  k_codes.dim() == 4, "contiguous code caches of one shape expected");
  TORCH_CHECK(k_codes.scalar_type() == v_codes.scalar_type() &&
                  (k_codes.scalar_type() == at::kChar || k_codes.scalar_type() == at::kFloat8_e4m3fn),
              "int8 or float8_e4m3fn code caches expected");
  TORCH_CHECK(k_scales.is_contiguous() && v_scales.is_contiguous() && k_scales.scalar_type() == at::kFloat &&
                  v_scales.scalar_type() == at::kFloat && k_scales.numel() == k_codes.numel() / k_codes.size(3) &&
                  v_scales.numel() == k_scales.numel(), "fp32 scales [blocks, block_size, kv_heads] expected");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_codes.size(2) && k.size(2) == k_codes.size(3),
              "k, v [T, kv_heads, head_dim] expected");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "each token's k and v must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0), "one slot per token");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_codes.size(0) * k_codes.size(1);
  for (int64_t t = 0; t < k.size(0); ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot outside the cache");
  const bool fp8 = k_codes.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t kvh = k.size(1), hd = k.size(2), T = k.size(0);
  auto* kc = static_cast<uint8_t*>(k_codes.data_ptr());
  auto* vc = static_cast<uint8_t*>(v_codes.data_ptr());
  LLMOPT_DISPATCH(k, [&] {
    const auto store = fp8 ? store_quantized_rows<scalar_t, true> : store_quantized_rows<scalar_t, false>;
    // tokens split across threads (a prefill chunk: thousands of rows)
    at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
      for (const auto& [x, codes, scales] : {std::tuple{&k, kc, &k_scales}, std::tuple{&v, vc, &v_scales}})
        store(x->data_ptr<scalar_t>() + begin * x->stride(0), x->stride(0), codes, scales->data_ptr<float>(),
              sp + begin, end - begin, kvh, hd);
    });
  });
}

bool vectorized() { return kVectorized; }

std::string isa() { return LLMOPT_STR(LLMOPT_ISA); }

}  // namespace llmopt_cpu::attention

// prefill attention over the step's own keys: the same unit (it uses max_of and softmax_numerators above)
#include "prefill_attention_cpu.cpp"
