// A decode step's decoder layers as one call (models/llama.py's `_forward_fused`, op for op): at batch-1 decode
// of a 135M model a layer's kernels take ~160 us and the Python between them (frames, argument parsing, the
// dispatcher: ~15 calls a layer) about as much again. The graph is built once per engine from the layers' own
// kernels and weights (each linear by the kernel its row plan chose: the same op, the same arguments, so the
// same bits) and run by `run`, which calls those kernels directly. Shapes: h [T, hidden] (the residual stream,
// updated in place), cos / sin [T, head_dim], slot_mapping [T], block_tables [T, blocks], context_lens [T];
// returns the final norm of h [T, hidden].
#include <torch/custom_class.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>

#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "ops.h"

namespace llmopt_cpu::graph {

// f() recorded for torch.profiler as the op `name` (the graph's kernels are called directly, not through the
// dispatcher that records ops): when no profiler runs, one flag read.
template <typename F>
auto recorded(const char* name, F&& f) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  return f();
}

// The kernels a graph's linear may call, by the name of their op (the Python layer's path names it); KERNEL_NAMES
// in the enum's order.
enum class Kernel {
  int4_matmul_q8, int4_matmul_q8_amx, int8_matmul_q8, int4_matmul_rows, int4_matmul_panels, int4_matmul_tiled, gemv,
  linear, onednn_linear
};
constexpr const char* KERNEL_NAMES[] = {"int4_matmul_q8",   "int4_matmul_q8_amx", "int8_matmul_q8",
                                        "int4_matmul_rows", "int4_matmul_panels", "int4_matmul_tiled",
                                        "gemv",             "linear",             "onednn_linear"};

// torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "") (oneDNN's linear on a weight prepacked by
// mkldnn._reorder_linear_weight: a dense layer's `prepacked` path), through the dispatcher: the op is torch's own,
// registered by libtorch, with no C++ API of its own.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

Kernel kernel_named(const std::string& name) {
  for (size_t i = 0; i < std::size(KERNEL_NAMES); ++i)
    if (name == KERNEL_NAMES[i]) return static_cast<Kernel>(i);
  TORCH_CHECK(false, "no decode-graph kernel named ", name);
}

// y [T, N] = x [T, K] W^T (+ bias): the kernel and the arguments after x its op takes.
struct Linear {
  Kernel kernel;
  // the op's arguments after x, tensors first, in its order: int4_matmul_q8(_amx): codes, scales_biases, group,
  // act_group; int8_matmul_q8: codes, scale[, shift], act_group; int4_matmul_rows / _tiled: nibbles,
  // scales_and_offsets, group (, tile_bytes); int4_matmul_panels: codes, scales_biases, group; gemv, linear: weight;
  // onednn_linear: the prepacked weight
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> ints;
  std::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    return recorded(KERNEL_NAMES[static_cast<int>(kernel)], [&] { return call(x); });
  }

  at::Tensor call(const at::Tensor& x) const {
    const auto& t = tensors;
    switch (kernel) {
      case Kernel::int4_matmul_q8: return with_bias(int4::int4_matmul_q8(x, t[0], t[1], ints[0], ints[1]));
      case Kernel::int4_matmul_q8_amx: return with_bias(int4::int4_matmul_q8_amx(x, t[0], t[1], ints[0], ints[1]));
      case Kernel::int8_matmul_q8: {
        const std::optional<at::Tensor> shift = t.size() > 2 ? std::optional<at::Tensor>(t[2]) : std::nullopt;
        return with_bias(int8::int8_matmul_q8(x, t[0], t[1], shift, ints[0]));
      }
      case Kernel::int4_matmul_rows: return with_bias(int4::int4_matmul_rows(x, t[0], t[1], ints[0]));
      case Kernel::int4_matmul_panels: return with_bias(int4::int4_matmul_panels(x, t[0], t[1], ints[0]));
      case Kernel::int4_matmul_tiled: return with_bias(int4::int4_matmul_tiled(x, t[0], t[1], ints[0], ints[1]));
      case Kernel::gemv: return with_bias(fused::gemv(x, t[0]));
      case Kernel::linear: return at::linear(x, t[0], bias);  // (F.linear's own bias handling, as the layer's)
      case Kernel::onednn_linear: return onednn_linear(x, t[0], bias);  // (the op adds the bias, as the layer's)
    }
    TORCH_CHECK(false, "unreachable");
  }

  at::Tensor with_bias(at::Tensor y) const { return bias ? y.add_(*bias) : y; }  // (the layer's `y + bias`)
};

struct Layer {
  Linear qkv, o_proj, gate_up, down_proj;
  at::Tensor post_norm, next_norm;  // [hidden]: after attention; the next layer's input norm (or the final norm)
  double post_eps, next_eps;
  std::vector<at::Tensor> cache;  // (key, value) or, 8-bit, (key codes, value codes, key scales, value scales)
};

// In a namespace of this build's own (LLMOPT_NS: llmopt_cpu_<isa>): torch maps a custom class's C++ type to its
// registered class, so one type name shared by two builds loaded in one process (the tests load each) sent an
// avx2 graph's method calls to the scalar build's class ("Tried to convert an IValue of type ...")
inline namespace LLMOPT_NS {

class DecodeGraph : public torch::CustomClassHolder {
 public:
  DecodeGraph(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, at::Tensor first_norm,
              double first_eps, bool fp8_cache)
      : nq_(num_heads), nkv_(num_kv_heads), hd_(head_dim), scale_(scale), first_norm_(std::move(first_norm)),
        first_eps_(first_eps), fp8_cache_(fp8_cache) {}

  // The layer's next linear, in the order qkv, o_proj, gate_up, down_proj (add_layer takes the four).
  void add_linear(const std::string& kernel, std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
                  std::optional<at::Tensor> bias) {
    TORCH_CHECK(pending_.size() < 4, "add_layer expected after four linears");
    pending_.push_back(Linear{kernel_named(kernel), std::move(tensors), std::move(ints), std::move(bias)});
  }

  void add_layer(at::Tensor post_norm, double post_eps, at::Tensor next_norm, double next_eps,
                 std::vector<at::Tensor> cache) {
    TORCH_CHECK(pending_.size() == 4, "four linears (qkv, o_proj, gate_up, down_proj) expected before add_layer");
    TORCH_CHECK(cache.size() == 2 || cache.size() == 4, "a layer's cache is 2 or 4 tensors");
    layers_.push_back(Layer{pending_[0], pending_[1], pending_[2], pending_[3], std::move(post_norm),
                            std::move(next_norm), post_eps, next_eps, std::move(cache)});
    pending_.clear();
  }

  at::Tensor run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                 const at::Tensor& block_tables, const at::Tensor& context_lens) const {
    const int64_t rows = h.size(0);
    TORCH_CHECK(block_tables.size(0) == rows && context_lens.size(0) == rows, "one decode per row expected");
    at::Tensor x = recorded("rms_norm", [&] { return fused::rms_norm(h, first_norm_, first_eps_); });
    for (const Layer& layer : layers_) {
      at::Tensor qkv = layer.qkv(x);  // [T, (H + 2 KVH) * D]
      recorded("rotary_", [&] { fused::rotary_(qkv, cos, sin, nq_ + nkv_); return 0; });
      const at::Tensor q = qkv.narrow(1, 0, nq_ * hd_).view({rows, nq_, hd_});
      const at::Tensor k = qkv.narrow(1, nq_ * hd_, nkv_ * hd_).view({rows, nkv_, hd_});
      const at::Tensor v = qkv.narrow(1, (nq_ + nkv_) * hd_, nkv_ * hd_).view({rows, nkv_, hd_});
      const at::Tensor o = attend(layer.cache, q, k, v, slot_mapping, block_tables, context_lens);
      const at::Tensor attn_out = layer.o_proj(o.reshape({rows, nq_ * hd_}));
      x = recorded("add_rms_norm_",
                   [&] { return fused::add_rms_norm_(h, attn_out, layer.post_norm, layer.post_eps); });
      const at::Tensor gate_up = layer.gate_up(x);  // [T, 2 I]
      const at::Tensor act = recorded("silu_mul", [&] { return fused::silu_mul(gate_up); });
      const at::Tensor mlp_out = layer.down_proj(act);
      x = recorded("add_rms_norm_",
                   [&] { return fused::add_rms_norm_(h, mlp_out, layer.next_norm, layer.next_eps); });
    }
    return x;
  }

 private:
  // This step's keys and values into their slots, then each query over its sequence's cache (the CPU
  // attention backend's store and decode).
  at::Tensor attend(const std::vector<at::Tensor>& cache, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& slots, const at::Tensor& tables,
                    const at::Tensor& lens) const {
    at::Tensor kc = cache[0], vc = cache[1];
    if (cache.size() == 2) {
      recorded("store_kv_", [&] { fused::store_kv_(kc, vc, k, v, slots); return 0; });
      return recorded("paged_decode_attention",
                      [&] { return attention::paged_decode_attention(q, kc, vc, tables, lens, scale_); });
    }
    at::Tensor ks = cache[2], vs = cache[3];
    recorded("store_kv_quantized_", [&] { attention::store_kv_quantized_(kc, vc, ks, vs, k, v, slots); return 0; });
    return recorded("paged_decode_attention_quantized", [&] {
      return attention::paged_decode_attention_quantized(q, kc.view(at::kByte), vc.view(at::kByte), ks, vs, tables,
                                                         lens, scale_, fp8_cache_);
    });
  }

  int64_t nq_, nkv_, hd_;
  double scale_;
  at::Tensor first_norm_;
  double first_eps_;
  bool fp8_cache_;
  std::vector<Linear> pending_;
  std::vector<Layer> layers_;
};

}  // namespace LLMOPT_NS

}  // namespace llmopt_cpu::graph
