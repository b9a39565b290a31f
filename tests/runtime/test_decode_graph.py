"""The decode graph (models/decode_graph.py, kernels/csrc/decode_graph_cpu.cpp): decode steps run the decoder's
layers as one compiled call that computes what the Python layer loop computes, bit for bit, for every kind of
linear and cache it takes; steps and engines it cannot serve keep the loop."""

import pytest
import torch

from llmopt.core.errors import ConfigError
from llmopt.runtime.engine.engine import Engine, EngineConfig
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops, decode_graph_class
from llmopt.runtime.executor.loader import load_runtime_model
from llmopt.runtime.executor.models.decode_graph import GRAPH_MAX_ROWS, DecodeGraphs, graph_calls

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the compiled CPU kernels are not available here")

# prompts of several lengths and outputs: prefill steps (the loop), then decodes of 4, 3, 2, 1 sequences as they
# finish
PROMPTS = [[5, 9, 200, 31], list(range(40, 77)), [7] * 20, [100, 3, 60]]


@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory):
    """The tiny Llama rounded to int8 per output row (RTN), as compressed-tensors."""
    from llmopt.compress.api import make_config, quantize_model
    from llmopt.core.tiny import build_tiny_model
    from llmopt.formats.artifact import write_model_artifact

    model, tok = build_tiny_model("llama", seed=0)
    config = make_config("rtn", bits=8, group_size=-1)
    result = quantize_model(model, tok, config)
    return write_model_artifact(tmp_path_factory.mktemp("art") / "int8", model, tok, result.qweights,
                                "compressed-tensors", config.record(), {"stages": []}, dense_dtype=torch.float32)


def engine(path, decode_graph: bool, activations: str = "int8", dtype: str = "float32", **settings) -> Engine:
    checkpoint, tok, _ = load_runtime_model(str(path), dtype=dtype, activations=activations)
    # (the fixed row plans: the same paths on every machine)
    return Engine(checkpoint, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, activations=activations,
                                                decode_graph=decode_graph, linear_kernels="fixed", **settings))


def run_counting_graph_steps(e: Engine, monkeypatch) -> tuple[list, list[int]]:
    """Every prompt's tokens and top-5 logprobs (floats: any difference in the hidden states shows), and the row
    counts of the steps that ran through a graph."""
    rows = []
    for_step = DecodeGraphs.for_step

    def counting(self, meta, kv_cache, num_rows):
        graph = for_step(self, meta, kv_cache, num_rows)
        if graph is not None:
            rows.append(num_rows)
        return graph

    monkeypatch.setattr(DecodeGraphs, "for_step", counting)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=5) for n in (9, 7, 5, 3)]
    outs = e.generate(PROMPTS, params)
    return [(o.token_ids, o.logprobs) for o in outs], rows


@pytest.mark.parametrize("kind", ["int4 8-bit inputs", "int4 float inputs", "int8 8-bit inputs", "fp32 dense",
                                  "fp32 dense int8 head", "int8 kv cache", "fp8 kv cache", "fp16 kv cache",
                                  "bf16 kv cache", "bf16 model fp16 kv cache", "fp16 model bf16 kv cache",
                                  "qwen2 biases", "bf16 dense", "fp32 dense prepacked", "bf16 dense prepacked"])
def test_the_graph_computes_what_the_layer_loop_does(kind, tiny_gptq_artifact, int8_artifact, tiny_llama_dir,
                                                     tiny_qwen2_dir, monkeypatch):
    path, settings = {
        "int4 8-bit inputs": (tiny_gptq_artifact, {}),
        "int4 float inputs": (tiny_gptq_artifact, {"activations": "float"}),
        "int8 8-bit inputs": (int8_artifact, {}),
        "fp32 dense": (tiny_llama_dir, {}),
        "fp32 dense int8 head": (tiny_llama_dir, {"lm_head": "int8"}),
        "int8 kv cache": (tiny_gptq_artifact, {"kv_cache_dtype": "int8"}),
        "fp8 kv cache": (tiny_llama_dir, {"kv_cache_dtype": "fp8"}),
        # an fp32 model over a 16-bit cache: the store rounds fp32 keys and values, the decode reads fp32 queries
        "fp16 kv cache": (tiny_gptq_artifact, {"kv_cache_dtype": "float16"}),
        "bf16 kv cache": (tiny_llama_dir, {"kv_cache_dtype": "bfloat16"}),
        # a 16-bit model over the other 16-bit cache type (a bf16 model beside llama.cpp's default f16 cache): the
        # store converts through fp32, the decode reads the queries in fp32
        "bf16 model fp16 kv cache": (tiny_gptq_artifact, {"dtype": "bfloat16", "kv_cache_dtype": "float16"}),
        "fp16 model bf16 kv cache": (tiny_llama_dir, {"dtype": "float16", "kv_cache_dtype": "bfloat16"}),
        "qwen2 biases": (tiny_qwen2_dir, {}),
        # gemv on the plain bf16 weights up to 8 rows; beyond, oneDNN on their prepacked copies where the CPU has
        # oneDNN's bf16, else oneDNN's GEMM on the plain weights
        "bf16 dense": (tiny_llama_dir, {"dtype": "bfloat16"}),
        # every dense layer through oneDNN on its prepacked copy (a plan's `prepacked` path), which the graph calls
        # through the dispatcher
        "fp32 dense prepacked": (tiny_llama_dir, {}),
        "bf16 dense prepacked": (tiny_llama_dir, {"dtype": "bfloat16"}),
    }[kind]
    if kind.endswith("prepacked"):
        from llmopt.runtime.executor.linear.dense import FusedDenseLinear, _mkldnn_bf16

        if not (_mkldnn_bf16() if "bf16" in kind else torch.backends.mkldnn.is_available()):
            pytest.skip("no oneDNN for this dtype here")
        default = FusedDenseLinear.default_path  # (the fp32 logits head has no copy: it is prepacked itself)
        monkeypatch.setattr(FusedDenseLinear, "default_path", lambda self, rows: (
            "prepacked" if self.prepacked_weight is not None else default(self, rows)))
    with_graph = engine(path, True, **settings)
    assert with_graph.runner.decode_graph_rows == list(range(1, GRAPH_MAX_ROWS + 1))
    if kind.endswith("prepacked"):
        assert {op for op, *_ in graph_calls(with_graph.runner.decoder, 1)} == {"onednn_linear"}
    assert with_graph.numerics()["decode_graph_rows"] == with_graph.runner.decode_graph_rows
    expected, loop_rows = run_counting_graph_steps(engine(path, False, **settings), monkeypatch)
    assert loop_rows == []
    got, graph_rows = run_counting_graph_steps(with_graph, monkeypatch)
    assert got == expected
    # the decodes ran through it, at each batch size the requests went through
    assert {1, 2, 3, 4} <= set(graph_rows)


def test_a_graph_runs_with_another_build_registered_before_this_cpus(tiny_llama_dir):
    """Each build's DecodeGraph is a C++ type of its own. With one type in every build, torch kept the class of the
    build registered first for it, and a later build's graph had its method calls refused ("Tried to convert an
    IValue of type ...avx2.DecodeGraph to ...scalar.DecodeGraph"). A fresh process loads the scalar build first."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops\n"
        "from llmopt.runtime.engine.engine import Engine, EngineConfig\n"
        "from llmopt.runtime.engine.sampling import SamplingParams\n"
        "from llmopt.runtime.executor.loader import load_runtime_model\n"
        "assert cpu_ops('scalar') is not None and cpu_ops() is not None\n"
        "model, tok, _ = load_runtime_model(sys.argv[1])\n"
        "e = Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, linear_kernels='fixed'))\n"
        "assert e.runner.decode_graph_rows\n"
        "[out] = e.generate([[5, 9, 200, 31]], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "print(len(out.token_ids))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tiny_llama_dir)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.split()[-1] == "4", done.stderr[-2000:]


def test_the_int8_layers_run_the_8_bit_kernel_in_the_graph(int8_artifact):
    runner = engine(int8_artifact, True).runner
    assert set(runner.linear_methods) == {"int8-q8-cpu"}
    block = runner.decoder.blocks[0]
    assert block.qkv.graph_call(1)[0] == "int8_matmul_q8"


def test_steps_the_graph_cannot_serve_keep_the_layer_loop(tiny_llama_dir, monkeypatch):
    e = engine(tiny_llama_dir, True)
    graphs = e.runner.decoder.decode_graphs
    _, rows = run_counting_graph_steps(e, monkeypatch)
    # prefill steps (and steps mixing them with decodes) never reach a graph
    assert set(rows) <= {1, 2, 3, 4}
    # nor another KV cache than the one the graph writes, nor more rows than it was built for
    meta = type("Meta", (), {"decode": type("Decode", (), {"contiguous": True})(), "prefills": []})()
    assert graphs.for_step(meta, e.runner.kv_cache, 1) is not None
    assert graphs.for_step(meta, object(), 1) is None
    assert graphs.for_step(meta, e.runner.kv_cache, GRAPH_MAX_ROWS + 1) is None


@pytest.mark.parametrize("settings", [{"decode_graph": False}, {"attention_backend": "torch"}, {"fast_path": False}])
def test_engines_the_graph_cannot_serve_build_none(tiny_llama_dir, settings):
    checkpoint, tok, _ = load_runtime_model(str(tiny_llama_dir), activations="float")
    e = Engine(checkpoint, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, **settings))
    assert e.runner.decode_graph_rows == [] and e.runner.decoder.decode_graphs is None
    assert e.generate([[5, 9, 200]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    if "decode_graph" not in settings:  # asked for explicitly where it cannot run: refused, never silently unused
        with pytest.raises(ConfigError, match="--decode-graph: this engine cannot run its decodes as one compiled "
                                              "call.*drop --decode-graph"):
            Engine(checkpoint, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, decode_graph=True, **settings))


def test_a_layer_whose_path_has_no_graph_kernel_leaves_that_row_count_to_the_loop(tiny_gptq_artifact):
    e = engine(tiny_gptq_artifact, True)
    decoder = e.runner.decoder
    qkv = decoder.blocks[1].qkv
    table = qkv._row_plan.choices
    # a plan that runs a path without a graph kernel from 5 rows on ("dequantize": torch's GEMM over a scratch
    # buffer)
    from llmopt.runtime.executor.linear.kernel_plans import RowPlan

    qkv.set_row_plan(RowPlan({b: ("q8" if b < 8 else "dequantize") for b in table}))
    assert decoder.build_decode_graphs(e.runner.kv_cache) == list(range(1, 5))


def test_the_graph_refuses_malformed_programs():
    graph = decode_graph_class()()
    with pytest.raises(RuntimeError, match="no decode-graph kernel named"):
        graph.add_linear("int4_dequantize_out", [torch.zeros(1)], [], None)
    with pytest.raises(RuntimeError, match="no decode-graph op named"):
        graph.add_op("layer_norm", [0], [6], [], [], [])
    with pytest.raises(RuntimeError, match="reads register 7 before it is written"):
        graph.add_op("silu_mul", [7], [6], [], [], [])
    with pytest.raises(RuntimeError, match="writes register 9: the next new one expected"):
        graph.add_op("silu_mul", [0], [9], [], [], [])
    with pytest.raises(RuntimeError, match="attend's cache is 2 or 4 tensors"):
        graph.add_op("attend", [0, 1, 2], [6], [torch.zeros(1)] * 3, [0.25], [0])
    with pytest.raises(RuntimeError, match="linear names a linear added before it"):
        graph.add_op("linear", [0], [6], [], [], [0])
    with pytest.raises(RuntimeError, match="set_result names the register"):
        graph.run(torch.zeros(1, 4), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, dtype=torch.long),
                  torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))


def test_the_graph_is_the_layer_loop_recorded(tiny_llama_dir, monkeypatch):
    """The program is what the model's one layer loop calls, op for op: per layer the qkv linear, rotate,
    attend, merge_heads, o_proj, add_rms_norm_, gate_up, silu_mul, down_proj, add_rms_norm_ (after the first
    norm); nothing of the model is written in the graph itself."""
    from llmopt.runtime.executor.models import decode_graph

    e = engine(tiny_llama_dir, True)
    decoder = e.runner.decoder
    ops = []

    class Listing:
        def add_linear(self, *args):
            return len(ops)

        def add_op(self, name, inputs, outputs, tensors, reals, ints):
            ops.append(name)

        def set_result(self, reg):
            ops.append("result")

    monkeypatch.setattr(decode_graph, "decode_graph_class", lambda: Listing)
    decode_graph.new_graph(decoder, decode_graph.graph_calls(decoder, 1), e.runner.kv_cache)
    layer = ["linear", "rotate", "attend", "merge_heads", "linear", "add_rms_norm_", "linear", "silu_mul", "linear",
             "add_rms_norm_"]
    assert ops == ["rms_norm"] + layer * decoder.num_layers + ["result"]


@pytest.mark.parametrize("rotary_dim, scaling", [(16, 1.0), (64, 1.0), (128, 0.7), (20, 1.3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_hold_what_forward_computes(rotary_dim, scaling, dtype):
    # the fast path's cos / sin per step come from tables (RotaryEmbedding.lookup), grown as positions pass them
    from llmopt.runtime.executor.models.layers import RotaryEmbedding

    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rotary = RotaryEmbedding(inv_freq, scaling)
    for positions in ([0], [5, 17, 300], [1023], list(range(2000, 2013)), [3]):
        positions = torch.tensor(positions)
        for got, expected in zip(rotary.lookup(positions, dtype), rotary(positions, dtype)):
            assert torch.equal(got, expected)
    assert rotary._tables[dtype][0].shape[0] >= 2013


def test_a_complete_program_takes_no_more_ops():
    graph = decode_graph_class()()
    graph.add_op("silu_mul", [0], [6], [], [], [])
    graph.set_result(6)
    with pytest.raises(RuntimeError, match="add_op after set_result"):
        graph.add_op("silu_mul", [6], [7], [], [], [])
