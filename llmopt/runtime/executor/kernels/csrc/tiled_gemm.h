// Weight-only products at batched row counts: y [M, N] = x [M, K] @ W^T where W [N, K] is stored as integer
// codes. The weight is dequantized one tile of output rows at a time into a per-thread buffer sized to stay in
// the core's L2 cache, and each tile is multiplied by all M rows with the BLAS GEMM while it is hot. Against
// dequantizing W whole (a pass that writes and then re-reads 4 bytes per weight through the memory hierarchy)
// the weight's bytes cross memory once, as codes; against the few-row kernels that widen every code once per
// pair of rows, the widening is paid once per tile for all rows. Threads take whole tiles (their GEMMs then run
// single-threaded inside the parallel region).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include "simd.h"  // to_float, from_float

#include <algorithm>
#include <climits>
#include <type_traits>
#include <utility>
#include <vector>

// The Fortran BLAS sgemm torch's CPU build links (MKL or OpenBLAS) when it exports it; weak, so a torch
// without it still loads these kernels and the tiles go through at::mm_out instead (a few us more per tile).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace llmopt_cpu {
namespace {

// Rows of W per tile: tile_bytes of dequantized weight, a multiple of 16 rows, and at least two tiles per
// thread where W has that many rows (so the threads finish together).
inline int64_t tile_rows(int64_t N, int64_t K, int64_t element_bytes, int64_t tile_bytes) {
  int64_t rows = std::max<int64_t>(16, tile_bytes / std::max<int64_t>(K * element_bytes, 1) / 16 * 16);
  const int64_t threads = at::get_num_threads();
  while (rows > 16 && (N + rows - 1) / rows < 2 * threads) rows -= 16;
  return std::min(rows, N);
}

// y[:, n0 : n0 + rows] = x @ tile^T, tile [rows, K] row-major. In BLAS's column-major terms that is
// y^T [rows, M] (leading dimension N) = tile (transposed, lda K) @ x^T (lda K).
template <typename T>
inline void tile_gemm(const at::Tensor& x, const T* tile, int64_t rows, at::Tensor& y, int64_t n0) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  if constexpr (std::is_same_v<T, float>) {
    if (sgemm_ != nullptr && N < INT_MAX && K < INT_MAX && M < INT_MAX) {
      const char trans = 'T', plain = 'N';
      const int m = static_cast<int>(rows), n = static_cast<int>(M), k = static_cast<int>(K), ldc = static_cast<int>(N);
      const float one = 1.f, zero = 0.f;
      sgemm_(&trans, &plain, &m, &n, &k, &one, tile, &k, x.data_ptr<float>(), &k, &zero, y.data_ptr<float>() + n0,
             &ldc);
      return;
    }
  }
  // (worker threads do not inherit the caller's inference mode, under which y may have been made)
  c10::InferenceMode guard;
  const at::Tensor w = at::from_blob(const_cast<T*>(tile), {rows, K}, x.options());
  at::Tensor out = y.narrow(1, n0, rows);
  at::mm_out(out, x, w.t());
}

// dequantize(T* tile, n0, n1) writes W's rows n0..n1 into tile [n1 - n0, K].
template <typename T, typename Dequantize>
void tiled_matmul(const at::Tensor& x, at::Tensor& y, int64_t tile_bytes, const Dequantize& dequantize) {
  const int64_t K = x.size(1), N = y.size(1);
  const int64_t rows = tile_rows(N, K, sizeof(T), tile_bytes);
  const int64_t tiles = (N + rows - 1) / rows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> storage;  // reused across calls; float-sized slots hold any T
    const size_t floats = (rows * K * sizeof(T) + sizeof(float) - 1) / sizeof(float);
    if (storage.size() < floats) storage.resize(floats);
    T* tile = reinterpret_cast<T*>(storage.data());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * rows, n1 = std::min(N, n0 + rows);
      dequantize(tile, n0, n1);
      tile_gemm<T>(x, tile, n1 - n0, y, n0);
    }
  });
}

// The panel kernels' row loop (int4_matmul_panels, int8_matmul_panels): rows in chunks of MB, each chunk's
// accumulators in registers, so the chunk size is a template argument; a last partial chunk takes the
// instantiation of its own size. run(std::integral_constant<int, rows>{}, first_row).
template <int MB, typename Run>
inline void row_chunks(int64_t M, const Run& run, int64_t first = 0) {
  if constexpr (MB > 0) {
    int64_t m = first;
    for (; m + MB <= M; m += MB) run(std::integral_constant<int, MB>{}, m);
    if (m < M) row_chunks<MB - 1>(M, run, m);
  }
}

// The few-row kernels' loop over outputs (the sparse ones): the inputs widened to fp32 once, blocks of
// OUTPUT_BLOCK outputs spread over the threads (a block's weights stay in cache while each chunk of rows reads
// them), rows MB at a time (row_chunks<RB>), outputs NB at a time with a tail of one.
// outputs(rows, count, x_rows, y_rows, n) computes rows x_rows.. (fp32, stride K) of outputs n..n + count into
// y_rows (fp32, stride N), `rows` and `count` as std::integral_constant; y [M, N] gets the results in its dtype.
constexpr int64_t OUTPUT_BLOCK = 16;

template <typename T, int RB, int NB, typename Outputs>
void few_rows_by_output_blocks(const at::Tensor& x, at::Tensor& y, const Outputs& outputs) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  std::vector<float> xf(M * K);
  const T* xp = x.data_ptr<T>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(xp[i]);
  std::vector<float> out(M * N);
  at::parallel_for(0, (N + OUTPUT_BLOCK - 1) / OUTPUT_BLOCK, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * OUTPUT_BLOCK, n1 = std::min(N, n0 + OUTPUT_BLOCK);
      row_chunks<RB>(M, [&](auto rows, int64_t m) {
        int64_t n = n0;
        for (; n + NB <= n1; n += NB) outputs(rows, std::integral_constant<int, NB>{}, xf.data() + m * K, out.data() + m * N, n);
        for (; n < n1; ++n) outputs(rows, std::integral_constant<int, 1>{}, xf.data() + m * K, out.data() + m * N, n);
      });
    }
  });
  T* yp = y.data_ptr<T>();
  for (int64_t i = 0; i < M * N; ++i) yp[i] = from_float<T>(out[i]);
}

}  // namespace
}  // namespace llmopt_cpu
