// The sum of a small tensor over the tensor-parallel ranks of one host, through a shared-memory segment
// (parallel/group.py's SharedMemoryAllReduce gives its layout): a header of int64 per rank [sequence, pid], then
// per rank two buffers of `buffer_bytes`, alternating by the sequence's parity. In Python each call cost ~40 us
// of interpreter time on a 2-core EPYC (x 2 per layer per step); here ~1-2 us plus the wait for the peers.
#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LLMOPT_SPIN_PAUSE() _mm_pause()
#else
#define LLMOPT_SPIN_PAUSE() ((void)0)
#endif

#include "ops.h"
#include "simd.h"

namespace llmopt_cpu::comm {

namespace {
constexpr int64_t kHeader = 2;  // int64 per rank: [sequence published, pid]
constexpr int64_t kSpinsBeforeYield = 1 << 12;  // pause instructions (~0.1-0.3 ms) before yielding the core

// parts [world] of n values each, summed in rank order (every rank gets the same bits) into out
template <typename T>
void sum_parts(const uint8_t* first, int64_t stride, int64_t world, int64_t n, T* out) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = static_cast<float>(reinterpret_cast<const T*>(first)[i]);
    for (int64_t r = 1; r < world; ++r) {
      acc += static_cast<float>(reinterpret_cast<const T*>(first + r * stride)[i]);
      if constexpr (!std::is_same_v<T, float>) acc = static_cast<float>(static_cast<T>(acc));  // as torch.add rounds
    }
    out[i] = static_cast<T>(acc);
  }
}
}  // namespace

// x: this rank's contiguous CPU tensor (fp32/bf16/fp16), replaced by the sum once every rank published `seq`.
// published: this rank already copied x and published seq (a call resuming its wait). Waits up to wait_s;
// returns 0 when done, else 1 + the first rank not yet arrived (the caller checks on it and calls again).
int64_t shm_all_reduce_(at::Tensor& x, const at::Tensor& region, int64_t rank, int64_t world, int64_t seq,
                        int64_t buffer_bytes, double wait_s, bool published) {
  TORCH_CHECK(x.is_contiguous() && region.is_contiguous(), "shm_all_reduce_: contiguous tensors expected");
  const int64_t nbytes = x.numel() * x.element_size();
  TORCH_CHECK(nbytes <= buffer_bytes, "shm_all_reduce_: tensor larger than the buffer");
  uint8_t* base = region.data_ptr<uint8_t>();
  auto* header = reinterpret_cast<std::atomic<int64_t>*>(base);
  uint8_t* buffers = base + sizeof(int64_t) * kHeader * world + (seq % 2) * world * buffer_bytes;
  if (!published) {
    std::memcpy(buffers + rank * buffer_bytes, x.data_ptr(), nbytes);
    header[rank * kHeader].store(seq, std::memory_order_release);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  for (int64_t r = 0; r < world; ++r) {
    int64_t spins = 0;
    while (header[r * kHeader].load(std::memory_order_acquire) < seq) {
      LLMOPT_SPIN_PAUSE();
      // a peer late by more than ~0.1 ms is most likely waiting for a core (more ranks than cores): give it ours
      if (++spins > kSpinsBeforeYield) std::this_thread::yield();
      if (spins % 4096 == 0 && std::chrono::steady_clock::now() > deadline) return r + 1;
    }
  }
  LLMOPT_DISPATCH(x, [&] { sum_parts<scalar_t>(buffers, buffer_bytes, world, x.numel(), x.data_ptr<scalar_t>()); });
  return 0;
}

}  // namespace llmopt_cpu::comm
