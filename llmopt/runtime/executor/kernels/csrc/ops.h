// The CPU kernels' entry points (one torch op each, registered in register.cpp). Shapes: see each definition.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace llmopt_cpu::attention {
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);
at::Tensor paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& v_codes,
                                            const at::Tensor& k_scales, const at::Tensor& v_scales,
                                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                                            double scale, bool fp8);
void store_kv_quantized_(at::Tensor& k_codes, at::Tensor& v_codes, at::Tensor& k_scales, at::Tensor& v_scales,
                         const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping);
bool vectorized();
std::string isa();
}  // namespace llmopt_cpu::attention

namespace llmopt_cpu::prefill {
at::Tensor causal_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    int64_t new_tokens, double scale);
}  // namespace llmopt_cpu::prefill

namespace llmopt_cpu::fused {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& logits);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads);
void store_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping);
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight);
}  // namespace llmopt_cpu::fused

namespace llmopt_cpu::int4 {
void int4_dequantize_out(const at::Tensor& nibbles, const at::Tensor& scales_and_offsets, int64_t group,
                         at::Tensor& out);
at::Tensor int4_matmul_rows(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& so, int64_t group);
at::Tensor int4_matmul_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_biases,
                          int64_t group, int64_t act_group);
// the same product on AMX-INT8 tiles (the avx512_bf16 build; amx_int8() says whether this CPU and OS run it)
at::Tensor int4_matmul_q8_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_biases,
                              int64_t group, int64_t act_group);
bool amx_int8();
// bf16 inputs times the same codes dequantized a panel at a time on AMX-BF16 tiles (the float path's numbers)
at::Tensor int4_matmul_amx_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_biases,
                                int64_t group);
bool amx_bf16();
at::Tensor int4_matmul_panels(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_biases,
                              int64_t group);
at::Tensor int4_matmul_tiled(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& so, int64_t group,
                             int64_t tile_bytes);
}  // namespace llmopt_cpu::int4

namespace llmopt_cpu::fp4 {
at::Tensor fp4_matmul_rows(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scale_bytes,
                           const at::Tensor& table, int64_t group);
void fp4_dequantize_out(const at::Tensor& nibbles, const at::Tensor& scale_bytes, const at::Tensor& table,
                        int64_t group, at::Tensor& out);
}  // namespace llmopt_cpu::fp4

namespace llmopt_cpu::int8 {
std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x);
at::Tensor scale_int32_rows(const at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& col_scale,
                            at::ScalarType dtype);
at::Tensor int8_gemv_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                          const at::Tensor& weight_sum, at::ScalarType dtype);
at::Tensor int8_matmul_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const std::optional<at::Tensor>& shift);
at::Tensor int8_matmul_panels(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const std::optional<at::Tensor>& shift);
at::Tensor int8_matmul_tiled(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                             const std::optional<at::Tensor>& shift, int64_t tile_bytes);
// int8 weights [N/16, K/4, 64] (quant_matmul.pack_int8_q8) times 8-bit inputs, integer dots (int8_q8_cpu.cpp)
at::Tensor int8_matmul_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                          const std::optional<at::Tensor>& shift, int64_t act_group);
}  // namespace llmopt_cpu::int8

namespace llmopt_cpu::sparse24 {
at::Tensor sparse24_matmul_rows(const at::Tensor& x, const at::Tensor& values, const at::Tensor& positions);
at::Tensor sparse24_matmul_tiled(const at::Tensor& x, const at::Tensor& values, const at::Tensor& positions,
                                 const at::Tensor& bitmask, int64_t tile_bytes);
void sparse24_decompress_out(const at::Tensor& values, const at::Tensor& positions, const at::Tensor& bitmask,
                             at::Tensor& out);
at::Tensor sparse24_int4_matmul_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& positions,
                                     const at::Tensor& scale, const at::Tensor& offset, int64_t group);
at::Tensor sparse24_int4_matmul_tiled(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& positions,
                                      const at::Tensor& scale, const at::Tensor& offset, const at::Tensor& bitmask,
                                      int64_t group, int64_t tile_bytes);
void sparse24_int4_decompress_out(const at::Tensor& codes, const at::Tensor& positions, const at::Tensor& scale,
                                  const at::Tensor& offset, const at::Tensor& bitmask, int64_t group, at::Tensor& out);
}  // namespace llmopt_cpu::sparse24

namespace llmopt_cpu::sparse_bitmask {
at::Tensor bitmask_matmul_rows(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmask,
                               const at::Tensor& row_offsets);
at::Tensor bitmask_matmul_tiled(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmask,
                                const at::Tensor& row_offsets, int64_t tile_bytes);
void bitmask_decompress_out(const at::Tensor& values, const at::Tensor& bitmask, const at::Tensor& row_offsets,
                            at::Tensor& out);
}  // namespace llmopt_cpu::sparse_bitmask

namespace llmopt_cpu::comm {
int64_t shm_all_reduce_(at::Tensor& x, const at::Tensor& region, int64_t rank, int64_t world, int64_t seq,
                        int64_t buffer_bytes, double wait_s, bool published);
}  // namespace llmopt_cpu::comm
