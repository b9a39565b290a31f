// A decode step's decoder layers as one call: a program recorded from the model's own layer loop
// (models/llama.py `_layers`, run once with models/decode_graph.py's recorder standing in for its ops, linears and
// attention), executed here. At batch-1 decode of a 135M model a layer's kernels take ~160 us and the Python between
// them (frames, argument parsing, the dispatcher: ~15 calls a layer) about as much again. Each instruction is one
// of the loop's ops on registers (tensors) with its constant tensors and numbers; each linear is the kernel its row
// plan chose (the same op, the same arguments, so the same bits). The program knows no model: the loop decides
// what runs. Registers 0-5 hold run()'s inputs: h [T, hidden] (the residual stream, updated in place), cos / sin
// [T, head_dim], slot_mapping [T], block_tables [T, blocks], context_lens [T]; run() returns the register
// set_result named.
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

// The member of enum E whose name (in the enum's order in `names`) is `name`; `what` names the kind in the error.
template <typename E, size_t N>
E named(const char* const (&names)[N], const std::string& name, const char* what) {
  for (size_t i = 0; i < N; ++i)
    if (name == names[i]) return static_cast<E>(i);
  TORCH_CHECK(false, "no decode-graph ", what, " named ", name);
}

Kernel kernel_named(const std::string& name) { return named<Kernel>(KERNEL_NAMES, name, "kernel"); }

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

// The ops a program runs (models/layer_ops.py's, as the recorder names them); OP_NAMES in the enum's order.
enum class Op { rms_norm, linear, rotate, attend, merge_heads, add_rms_norm_, silu_mul };
constexpr const char* OP_NAMES[] = {"rms_norm", "linear", "rotate", "attend", "merge_heads", "add_rms_norm_",
                                    "silu_mul"};
// registers read and written by each op
constexpr int OP_INPUTS[] = {1, 1, 1, 3, 1, 2, 1};
constexpr int OP_OUTPUTS[] = {1, 1, 3, 1, 1, 1, 1};
constexpr int64_t INPUT_REGISTERS = 6;  // h, cos, sin, slot_mapping, block_tables, context_lens

Op op_named(const std::string& name) { return named<Op>(OP_NAMES, name, "op"); }

// One op of the program: registers in and out; constants: rms_norm / add_rms_norm_ the norm's weight and eps;
// linear its index; rotate the heads (query, key/value) and head size; attend the layer's cache tensors, the
// softmax scale and whether an 8-bit cache holds FP8.
struct Instruction {
  Op op;
  std::vector<int64_t> in, out;
  std::vector<at::Tensor> tensors;
  std::vector<double> reals;
  std::vector<int64_t> ints;
};

// In a namespace of this build's own (LLMOPT_NS: llmopt_cpu_<isa>): torch maps a custom class's C++ type to its
// registered class, so one type name shared by two builds loaded in one process (the tests load each) sent an
// avx2 graph's method calls to the scalar build's class ("Tried to convert an IValue of type ...")
inline namespace LLMOPT_NS {

class DecodeGraph : public torch::CustomClassHolder {
 public:
  DecodeGraph() = default;

  // A linear the program's "linear" ops may call, by the index returned.
  int64_t add_linear(const std::string& kernel, std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
                     std::optional<at::Tensor> bias) {
    linears_.push_back(Linear{kernel_named(kernel), std::move(tensors), std::move(ints), std::move(bias)});
    return static_cast<int64_t>(linears_.size()) - 1;
  }

  // The program's next op; its output registers are new (never written before).
  void add_op(const std::string& name, std::vector<int64_t> in, std::vector<int64_t> out,
              std::vector<at::Tensor> tensors, std::vector<double> reals, std::vector<int64_t> ints) {
    TORCH_CHECK(result_ < 0, "add_op after set_result: the program is complete");
    const Op op = op_named(name);
    const int k = static_cast<int>(op);
    TORCH_CHECK(static_cast<int>(in.size()) == OP_INPUTS[k] && static_cast<int>(out.size()) == OP_OUTPUTS[k],
                name, " takes ", OP_INPUTS[k], " registers and writes ", OP_OUTPUTS[k]);
    for (int64_t r : in) TORCH_CHECK(r >= 0 && r < registers_, name, " reads register ", r, " before it is written");
    for (size_t j = 0; j < out.size(); ++j)
      TORCH_CHECK(out[j] == registers_ + static_cast<int64_t>(j), name, " writes register ", out[j],
                  ": the next new one expected");
    const size_t wanted_tensors[] = {1, 0, 0, 0, 0, 1, 0};
    if (op == Op::attend) {
      TORCH_CHECK(tensors.size() == 2 || tensors.size() == 4, "attend's cache is 2 or 4 tensors");
      TORCH_CHECK(reals.size() == 1 && ints.size() == 1, "attend takes the scale and the fp8 flag");
    } else {
      TORCH_CHECK(tensors.size() == wanted_tensors[k], name, " takes ", wanted_tensors[k], " tensors");
    }
    if (op == Op::linear)
      TORCH_CHECK(ints.size() == 1 && ints[0] >= 0 && ints[0] < static_cast<int64_t>(linears_.size()),
                  "linear names a linear added before it");
    if (op == Op::rotate) TORCH_CHECK(ints.size() == 3, "rotate takes the heads, the key/value heads and head size");
    if (op == Op::rms_norm || op == Op::add_rms_norm_) TORCH_CHECK(reals.size() == 1, name, " takes its eps");
    registers_ += static_cast<int64_t>(out.size());  // (a refused op changes nothing)
    program_.push_back(Instruction{op, std::move(in), std::move(out), std::move(tensors), std::move(reals),
                                   std::move(ints)});
  }

  // The program is complete: `reg` is what run returns. Each register is released after the op that reads it last
  // (as the Python loop's temporaries go out of scope), so a step's intermediates reuse memory still in cache rather
  // than all of them living until its end.
  void set_result(int64_t reg) {
    TORCH_CHECK(reg >= 0 && reg < registers_, "the result register ", reg, " is never written");
    result_ = reg;
    std::vector<int64_t> last(registers_, -1);  // register -> the last op reading it
    for (size_t i = 0; i < program_.size(); ++i)
      for (int64_t r : program_[i].in) last[r] = static_cast<int64_t>(i);
    releases_.assign(program_.size(), {});
    for (int64_t r = INPUT_REGISTERS; r < registers_; ++r)
      if (r != result_ && last[r] >= 0) releases_[last[r]].push_back(r);
  }

  at::Tensor run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                 const at::Tensor& block_tables, const at::Tensor& context_lens) const {
    const int64_t rows = h.size(0);
    TORCH_CHECK(block_tables.size(0) == rows && context_lens.size(0) == rows, "one decode per row expected");
    TORCH_CHECK(result_ >= 0, "set_result names the register run returns");
    std::vector<at::Tensor> r(registers_);
    r[0] = std::move(h), r[1] = cos, r[2] = sin, r[3] = slot_mapping, r[4] = block_tables, r[5] = context_lens;
    for (size_t i = 0; i < program_.size(); ++i) {
      execute(program_[i], r);
      for (int64_t released : releases_[i]) r[released].reset();
    }
    return r[result_];
  }

 private:
  void execute(const Instruction& i, std::vector<at::Tensor>& r) const {
    const auto& in = i.in;
    at::Tensor& out = r[i.out[0]];
    switch (i.op) {
      case Op::rms_norm:
        out = recorded("rms_norm", [&] { return fused::rms_norm(r[in[0]], i.tensors[0], i.reals[0]); });
        return;
      case Op::linear: out = linears_[i.ints[0]](r[in[0]]); return;
      case Op::rotate: {
        // rotary in place on q and k, then the three views ([T, H, D], [T, KVH, D] twice)
        at::Tensor& qkv = r[in[0]];
        const int64_t rows = qkv.size(0), nq = i.ints[0], nkv = i.ints[1], hd = i.ints[2];
        recorded("rotary_", [&] { fused::rotary_(qkv, r[1], r[2], nq + nkv); return 0; });
        r[i.out[0]] = qkv.narrow(1, 0, nq * hd).view({rows, nq, hd});
        r[i.out[1]] = qkv.narrow(1, nq * hd, nkv * hd).view({rows, nkv, hd});
        r[i.out[2]] = qkv.narrow(1, (nq + nkv) * hd, nkv * hd).view({rows, nkv, hd});
        return;
      }
      case Op::attend: out = attend(i, r[in[0]], r[in[1]], r[in[2]], r[3], r[4], r[5]); return;
      case Op::merge_heads: out = r[in[0]].reshape({r[in[0]].size(0), -1}); return;
      case Op::add_rms_norm_:
        out = recorded("add_rms_norm_",
                       [&] { return fused::add_rms_norm_(r[in[0]], r[in[1]], i.tensors[0], i.reals[0]); });
        return;
      case Op::silu_mul: out = recorded("silu_mul", [&] { return fused::silu_mul(r[in[0]]); }); return;
    }
  }

  // This step's keys and values into their slots, then each query over its sequence's cache (the CPU
  // attention backend's store and decode).
  at::Tensor attend(const Instruction& i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens) const {
    const auto& cache = i.tensors;
    const double scale = i.reals[0];
    at::Tensor kc = cache[0], vc = cache[1];
    if (cache.size() == 2) {
      recorded("store_kv_", [&] { fused::store_kv_(kc, vc, k, v, slots); return 0; });
      return recorded("paged_decode_attention",
                      [&] { return attention::paged_decode_attention(q, kc, vc, tables, lens, scale); });
    }
    at::Tensor ks = cache[2], vs = cache[3];
    recorded("store_kv_quantized_", [&] { attention::store_kv_quantized_(kc, vc, ks, vs, k, v, slots); return 0; });
    return recorded("paged_decode_attention_quantized", [&] {
      return attention::paged_decode_attention_quantized(q, kc.view(at::kByte), vc.view(at::kByte), ks, vs, tables,
                                                         lens, scale, i.ints[0] != 0);
    });
  }

  std::vector<Linear> linears_;
  std::vector<Instruction> program_;
  std::vector<std::vector<int64_t>> releases_;  // per op: the registers it read last (set_result)
  int64_t registers_ = INPUT_REGISTERS;
  int64_t result_ = -1;
};

}  // namespace LLMOPT_NS

}  // namespace llmopt_cpu::graph
