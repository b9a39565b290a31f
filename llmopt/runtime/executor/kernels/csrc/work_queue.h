// Work shared out so that no thread waits for a slower one: each thread takes the chunks of its own contiguous
// share front to back, and a thread that finishes takes the chunks still left at the back of the others' shares.
// at::parallel_for's equal shares make every call wait for its slowest thread; on a 2-vCPU cloud VM one vCPU
// often runs 30-40% slower than the other for seconds at a time (the host's other guests), and then two threads
// do twice the slow one's work instead of the sum of both. Measured on a 2-core AVX2 EPYC VM (family 23),
// int4_matmul_q8 at 8 rows x 3072 x 576: one thread alone 12.7 or 20.5 G multiply-adds/s depending on the moment,
// two threads with equal shares 25-26 (twice the slow one). Handing every chunk out from one shared counter instead
// (as llama.cpp's matmul does) broke each thread's sequential stream of weights: a decode step's int4 linears
// (weights from memory) took 6-20% longer at 1 and 2 rows and 8-10% at 8 when both vCPUs ran alike; with a share
// of its own front to back a thread's chunks are one stream, as before, until it steals.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace llmopt_cpu {
namespace {

constexpr int64_t CHUNKS_PER_THREAD = 8;  // fine enough to even out a slow thread

// One thread's share: its unclaimed chunks [front, back) in one word (front in the low 32 bits), so the owner
// taking the front and a thief taking the back never take the same chunk. (A line of its own: the owner updates it
// at every chunk.)
struct alignas(64) Share {
  std::atomic<uint64_t> left{0};
  static uint64_t pack(uint64_t front, uint64_t back) { return front | back << 32; }
  // the next chunk from the front (owner) or the back (thief); -1 when none is left
  int64_t claim(bool from_back) {
    uint64_t word = left.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t front = word & 0xffffffffu, back = word >> 32;
      if (front >= back) return -1;
      const uint64_t taken = from_back ? pack(front, back - 1) : pack(front + 1, back);
      if (left.compare_exchange_weak(word, taken, std::memory_order_relaxed))
        return static_cast<int64_t>(from_back ? back - 1 : front);
    }
  }
};

// fn(begin, end) over [0, n): each thread's share is what at::parallel_for(0, n, align, ...) would give it (the same
// bounds), taken in chunks of a multiple of `align` items (about CHUNKS_PER_THREAD a thread; a share's last chunk
// may be shorter). A chunk's results must not depend on which thread computes it or on where the
// chunk starts (the kernels that use it compute each output the same way in any range).
template <typename F>
void parallel_chunks(int64_t n, int64_t align, const F& fn) {
  if (n <= 0) return;
  const int64_t threads = at::get_num_threads();
  const int64_t target = (n + CHUNKS_PER_THREAD * threads - 1) / (CHUNKS_PER_THREAD * threads);
  const int64_t chunk = std::max<int64_t>(1, (target + align - 1) / align) * align;
  const int64_t shares = std::min(threads, (n + align - 1) / align);
  if (shares <= 1 || at::in_parallel_region()) return fn(0, n);
  // share s: items [first(s), first(s + 1)), its chunks counted from its first item
  const int64_t per_share = (n + shares - 1) / shares;
  const auto first = [&](int64_t s) { return std::min(n, s * per_share); };
  std::unique_ptr<Share[]> share(new Share[shares]);
  for (int64_t s = 0; s < shares; ++s)
    share[s].left.store(Share::pack(0, (first(s + 1) - first(s) + chunk - 1) / chunk));
  const auto run = [&](int64_t s, int64_t c) {
    fn(first(s) + c * chunk, std::min(first(s + 1), first(s) + (c + 1) * chunk));
  };
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      for (int64_t c = share[s].claim(false); c >= 0; c = share[s].claim(false)) run(s, c);
    for (int64_t k = 1; k < shares; ++k) {  // then the others' backs, the next share on first
      const int64_t s = (end - 1 + k) % shares;
      for (int64_t c = share[s].claim(true); c >= 0; c = share[s].claim(true)) run(s, c);
    }
  });
}

}  // namespace
}  // namespace llmopt_cpu
