// Work handed out to the threads in chunks from one shared counter (as llama.cpp's matmul does), instead of
// at::parallel_for's equal shares fixed up front. With equal shares a call waits for its slowest thread; on a
// 2-vCPU cloud VM one vCPU often runs 30-40% slower than the other for seconds at a time (a host's other guests),
// and then two threads do twice the slow one's work instead of the sum of both. Measured on a 2-core AVX2 EPYC VM
// (family 23), int4_matmul_q8 at 8 rows x 3072 x 576: one thread alone 12.7 or 20.5 G multiply-adds/s depending
// on the moment, two threads with equal shares 25-26 (twice the slow one).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace llmopt_cpu {
namespace {

constexpr int64_t CHUNKS_PER_THREAD = 8;  // fine enough to even out a slow thread, coarse enough that each chunk
                                          // is one long contiguous stream of weights for the hardware prefetcher

// fn(begin, end) over [0, n) in chunks of a multiple of `align` items (about CHUNKS_PER_THREAD a thread), each
// taken by whichever thread is free next. A chunk's results must not depend on which thread computes it or on
// where the chunk starts (the kernels that use it compute each output the same way in any range).
template <typename F>
void parallel_chunks(int64_t n, int64_t align, const F& fn) {
  if (n <= 0) return;
  const int64_t threads = at::get_num_threads();
  const int64_t target = (n + CHUNKS_PER_THREAD * threads - 1) / (CHUNKS_PER_THREAD * threads);
  const int64_t chunk = std::max<int64_t>(1, (target + align - 1) / align) * align;
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (threads <= 1 || chunks <= 1 || at::in_parallel_region()) return fn(0, n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

}  // namespace
}  // namespace llmopt_cpu
