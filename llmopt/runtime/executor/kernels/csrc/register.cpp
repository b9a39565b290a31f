// Every CPU kernel as a torch op, in one place: torch.ops.llmopt_cpu_<isa>.<name> (LLMOPT_NS names the
// build's instruction set, so builds for different CPUs never share a namespace).
#include <torch/library.h>

#include "ops.h"
#include "simd.h"  // LLMOPT_NS

// One more macro level, so LLMOPT_NS expands before TORCH_LIBRARY pastes it into identifiers.
#define LLMOPT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LLMOPT_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

LLMOPT_LIBRARY(LLMOPT_NS, m) {
  using namespace llmopt_cpu;
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("paged_decode_attention_quantized(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_scales, "
        "Tensor v_scales, Tensor block_tables, Tensor context_lens, float scale, bool fp8) -> Tensor");
  m.def("store_kv_quantized_(Tensor(a!) k_codes, Tensor(b!) v_codes, Tensor(c!) k_scales, Tensor(d!) v_scales, "
        "Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("causal_prefill_attention(Tensor q, Tensor k, Tensor v, int new_tokens, float scale) -> Tensor");
  m.def("vectorized", &attention::vectorized);  // whether this build has the vector (AVX2 or AVX-512) paths
  m.def("isa", &attention::isa);  // the instruction set this build was compiled for
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, int num_heads) -> ()");
  m.def("store_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("gemv(Tensor x, Tensor weight) -> Tensor");
  m.def("int4_dequantize_out(Tensor nibbles, Tensor scales_and_offsets, int group, Tensor(a!) out) -> ()");
  m.def("int4_matmul_rows(Tensor x, Tensor nibbles, Tensor scales_and_offsets, int group) -> Tensor");
  m.def("int4_matmul_q8(Tensor x, Tensor codes, Tensor scales_biases, int group, int act_group) -> Tensor");
  m.def("int4_matmul_q8_amx(Tensor x, Tensor codes, Tensor scales_biases, int group, int act_group) -> Tensor");
  m.def("amx_int8", &int4::amx_int8);  // whether int4_matmul_q8_amx runs here (CPU, OS permission, build)
  m.def("int4_matmul_amx_bf16(Tensor x, Tensor codes, Tensor scales_biases, int group) -> Tensor");
  m.def("amx_bf16", &int4::amx_bf16);  // whether int4_matmul_amx_bf16 runs here
  m.def("int4_matmul_panels(Tensor x, Tensor codes, Tensor scales_biases, int group) -> Tensor");
  m.def("int4_matmul_tiled(Tensor x, Tensor nibbles, Tensor scales_and_offsets, int group, int tile_bytes) -> Tensor");
  m.def("fp4_matmul_rows(Tensor x, Tensor nibbles, Tensor scale_bytes, Tensor scale_table, int group) -> Tensor");
  m.def("fp4_dequantize_out(Tensor nibbles, Tensor scale_bytes, Tensor scale_table, int group, Tensor(a!) out) -> ()");
  m.def("quantize_rows_int8(Tensor x) -> (Tensor, Tensor)");
  m.def("scale_int32_rows(Tensor acc, Tensor row_scale, Tensor col_scale, ScalarType dtype) -> Tensor");
  m.def("int8_matmul_rows(Tensor x, Tensor codes, Tensor scale, Tensor? shift) -> Tensor");
  m.def("int8_matmul_panels(Tensor x, Tensor codes, Tensor scale, Tensor? shift) -> Tensor");
  m.def("int8_matmul_q8(Tensor x, Tensor codes, Tensor scale, Tensor? shift, int act_group) -> Tensor");
  m.def("int8_matmul_tiled(Tensor x, Tensor codes, Tensor scale, Tensor? shift, int tile_bytes) -> Tensor");
  m.def("int8_gemv_rows(Tensor x, Tensor weight, Tensor weight_scale, Tensor weight_sum, ScalarType dtype) -> Tensor");
  m.def("sparse24_matmul_rows(Tensor x, Tensor values, Tensor positions) -> Tensor");
  m.def("sparse24_matmul_tiled(Tensor x, Tensor values, Tensor positions, Tensor bitmask, int tile_bytes) -> Tensor");
  m.def("sparse24_decompress_out(Tensor values, Tensor positions, Tensor bitmask, Tensor(a!) out) -> ()");
  m.def("sparse24_int4_matmul_rows(Tensor x, Tensor codes, Tensor positions, Tensor scale, Tensor offset, "
        "int group) -> Tensor");
  m.def("sparse24_int4_matmul_tiled(Tensor x, Tensor codes, Tensor positions, Tensor scale, Tensor offset, "
        "Tensor bitmask, int group, int tile_bytes) -> Tensor");
  m.def("sparse24_int4_decompress_out(Tensor codes, Tensor positions, Tensor scale, Tensor offset, Tensor bitmask, "
        "int group, Tensor(a!) out) -> ()");
  m.def("bitmask_matmul_rows(Tensor x, Tensor values, Tensor bitmask, Tensor row_offsets) -> Tensor");
  m.def("bitmask_matmul_tiled(Tensor x, Tensor values, Tensor bitmask, Tensor row_offsets, int tile_bytes) -> Tensor");
  m.def("bitmask_decompress_out(Tensor values, Tensor bitmask, Tensor row_offsets, Tensor(a!) out) -> ()");
  m.def("shm_all_reduce_(Tensor(a!) x, Tensor region, int rank, int world, int seq, int buffer_bytes, float wait_s, "
        "bool published) -> int");
  // a decode step's layers as one call (decode_graph_cpu.cpp): torch.classes.llmopt_cpu_<isa>.DecodeGraph
  m.class_<graph::DecodeGraph>("DecodeGraph")
      .def(torch::init<>())
      .def("add_linear", &graph::DecodeGraph::add_linear)
      .def("add_op", &graph::DecodeGraph::add_op)
      .def("set_result", &graph::DecodeGraph::set_result)
      .def("run", &graph::DecodeGraph::run);
}

LLMOPT_LIBRARY_IMPL(LLMOPT_NS, CPU, m) {
  using namespace llmopt_cpu;
  m.impl("paged_decode_attention", attention::paged_decode_attention);
  m.impl("paged_decode_attention_quantized", attention::paged_decode_attention_quantized);
  m.impl("store_kv_quantized_", attention::store_kv_quantized_);
  m.impl("causal_prefill_attention", prefill::causal_prefill_attention);
  m.impl("rms_norm", fused::rms_norm);
  m.impl("add_rms_norm_", fused::add_rms_norm_);
  m.impl("silu_mul", fused::silu_mul);
  m.impl("argmax_rows", fused::argmax_rows);
  m.impl("rotary_", fused::rotary_);
  m.impl("store_kv_", fused::store_kv_);
  m.impl("gemv", fused::gemv);
  m.impl("int4_dequantize_out", int4::int4_dequantize_out);
  m.impl("int4_matmul_rows", int4::int4_matmul_rows);
  m.impl("int4_matmul_q8", int4::int4_matmul_q8);
  m.impl("int4_matmul_q8_amx", int4::int4_matmul_q8_amx);
  m.impl("int4_matmul_amx_bf16", int4::int4_matmul_amx_bf16);
  m.impl("int4_matmul_panels", int4::int4_matmul_panels);
  m.impl("int4_matmul_tiled", int4::int4_matmul_tiled);
  m.impl("fp4_matmul_rows", fp4::fp4_matmul_rows);
  m.impl("fp4_dequantize_out", fp4::fp4_dequantize_out);
  m.impl("quantize_rows_int8", int8::quantize_rows_int8);
  m.impl("scale_int32_rows", int8::scale_int32_rows);
  m.impl("int8_matmul_rows", int8::int8_matmul_rows);
  m.impl("int8_matmul_panels", int8::int8_matmul_panels);
  m.impl("int8_matmul_tiled", int8::int8_matmul_tiled);
  m.impl("int8_matmul_q8", int8::int8_matmul_q8);
  m.impl("int8_gemv_rows", int8::int8_gemv_rows);
  m.impl("sparse24_matmul_rows", sparse24::sparse24_matmul_rows);
  m.impl("sparse24_matmul_tiled", sparse24::sparse24_matmul_tiled);
  m.impl("sparse24_decompress_out", sparse24::sparse24_decompress_out);
  m.impl("sparse24_int4_matmul_rows", sparse24::sparse24_int4_matmul_rows);
  m.impl("sparse24_int4_matmul_tiled", sparse24::sparse24_int4_matmul_tiled);
  m.impl("sparse24_int4_decompress_out", sparse24::sparse24_int4_decompress_out);
  m.impl("bitmask_matmul_rows", sparse_bitmask::bitmask_matmul_rows);
  m.impl("bitmask_matmul_tiled", sparse_bitmask::bitmask_matmul_tiled);
  m.impl("bitmask_decompress_out", sparse_bitmask::bitmask_decompress_out);
  m.impl("shm_all_reduce_", comm::shm_all_reduce_);
}
