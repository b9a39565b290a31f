"""Weight-only int4 / int8 linears at every row count: the compiled kernels (few-row and tiled) against the
dequantized reference in every build this CPU runs, each path of the runtime's layers, and the per-row-count
choice of path (kernel_plans.py): its lookup, its measurement, its store, and the engine recording it."""

import json

import pytest
import torch

from llmopt.core.contract.rounding import quantize_rtn
from llmopt.core.contract import QuantScheme
from llmopt.core.errors import ConfigError
from llmopt.core.hardware import supported_kernel_isas
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.kernels.quant_matmul import (
    int4_dequantize, pack_int4_panels, pack_int8, pack_int8_panels, pack_nibbles, reference_quant_matmul,
)
from llmopt.runtime.executor.linear import make_linear
from llmopt.runtime.executor.linear import dense, kernel_plans
from llmopt.runtime.executor.linear.int4_cpu import Int4PackedLinear
from llmopt.runtime.executor.linear.int8_cpu import Int8PackedLinear
from llmopt.runtime.executor.linear.kernel_plans import ROW_BUCKETS, RowPlan, choose, measure_plan, plan_for

ROWS = (1, 3, 8, 9, 16, 64, 257)  # decode, speculative verification, the middle range, a prefill chunk
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(params=supported_kernel_isas())
def ops(request):
    built = cpu_ops(request.param)
    assert built is not None, f"the {request.param} kernels failed to build"
    return built


def close(out, expected, dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile_bytes", [4096, 1 << 20])  # 16-row tiles (a partial last one), one tile
def test_int4_panels_and_tiles_match_the_dequantized_weight(ops, dtype, tile_bytes):
    # 48 outputs: tiles of 16 rows, three panels of 16; 257 rows: 16 chunks of 16 (AVX2: 64 of 4) and one row
    n, k, group = 48, 192, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=g)
    so = torch.stack([torch.rand(k // group, n, generator=g) * 0.1, torch.randn(k // group, n, generator=g) * 0.1],
                     dim=-1).to(dtype)
    nibbles = pack_nibbles(q)
    weight = int4_dequantize(nibbles, so.float(), group)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g).to(dtype)
        out = ops.int4_matmul_tiled(x, nibbles, so, group, tile_bytes)
        assert out.dtype == dtype and out.shape == (rows, n)
        close(out, x.float() @ weight.t(), dtype)
        codes, scales_biases = pack_int4_panels(nibbles, so, group)
        close(ops.int4_matmul_panels(x, codes, scales_biases, group), x.float() @ weight.t(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sym", [True, False])
def test_int8_weight_only_kernels_match_the_dequantized_weight(ops, dtype, sym):
    n, k = 37, 200  # K not a multiple of 16: the scalar tail after the vectors
    g = torch.Generator().manual_seed(1)
    qw = quantize_rtn(torch.randn(n, k, generator=g), QuantScheme(8, -1, sym))
    codes, scale, shift = pack_int8(qw.q, qw.scales, qw.zeros, dtype)
    assert (shift is None) == sym
    # the dequantized weight as the kernels see it: scale and shift rounded to the compute dtype
    weight = scale.float()[:, None] * codes.float() + (0 if shift is None else shift.float()[:, None])
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g).to(dtype)
        expected = x.float() @ weight.t()
        close(ops.int8_matmul_rows(x, codes, scale, shift), expected, dtype)
        close(ops.int8_matmul_tiled(x, codes, scale, shift, 4096), expected, dtype)
        close(ops.int8_matmul_panels(x, pack_int8_panels(codes[:32]), scale[:32], None if sym else shift[:32]),
              expected[:, :32], dtype)


def qweight(n, k, bits, group_size, sym):
    g = torch.Generator().manual_seed(n + k)
    return quantize_rtn(torch.randn(n, k, generator=g), QuantScheme(bits, group_size, sym),
                        bias=torch.randn(n, generator=g))


@pytest.mark.parametrize("bits,group_size,kind", [(4, 64, Int4PackedLinear), (8, -1, Int8PackedLinear)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_of_a_layer_computes_its_product(bits, group_size, kind, dtype):
    qw = qweight(48, 192, bits, group_size, sym=False)
    layer = make_linear(qw, dtype)
    assert type(layer) is kind and len(layer.row_paths()) >= 2
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for rows in ROWS:
        x = torch.randn(rows, 192)
        expected = reference_quant_matmul(x.to(dtype).float(), qw.q, qw.scales, qw.zeros, qw.g_idx) + qw.bias
        for name in layer.row_paths():
            out = layer.run_path(name, x.to(dtype)) + layer.bias
            torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item(),
                                       msg=lambda m: f"path {name}, {rows} rows: {m}")


def test_a_dequantizing_path_timed_under_inference_mode_still_runs_outside_it():
    # the engine times the paths under torch.inference_mode (kernel_plans.measure_plan); its steps run outside it,
    # and the dequantized weight's reused buffer must not stay an inference tensor
    for bits, group_size in ((8, -1), (4, 64)):
        layer = make_linear(qweight(48, 192, bits, group_size, sym=False), torch.float32)
        x = torch.randn(32, 192)
        with torch.inference_mode():
            inside = layer.run_path("dequantize", x)
        torch.testing.assert_close(layer.run_path("dequantize", x), inside)


def test_a_plan_maps_each_row_count_to_its_bucket():
    plan = RowPlan({1: "rows", 2: "rows", 4: "tiled", 256: "dequantize"})
    assert [plan.path(m) for m in (1, 2, 3, 4, 5, 255, 256, 4096)] == [
        "rows", "rows", "tiled", "tiled", "dequantize", "dequantize", "dequantize", "dequantize"]
    stored = RowPlan(json.loads(json.dumps(plan.to_json())))  # through the JSON store: keys as text
    assert [stored.path(m) for m in range(600)] == [plan.path(m) for m in range(600)]


class TimedLayer(kernel_plans.RowPathsMixin):
    """A layer with two paths of known cost: 'slow' sleeps, 'quick' does not."""

    in_features, dtype = 8, torch.float32

    def __init__(self, default="slow", quick_limit=None):
        self.default, self.quick_limit, self.calls = default, quick_limit, []

    def row_paths(self):
        return {"slow": None, "quick": self.quick_limit}

    def default_path(self, rows):
        return self.default

    def row_plan_key(self):
        return "timed|float32|8x8"

    def run_path(self, name, x):
        self.calls.append((name, x.shape[0]))
        if name == "slow":
            import time
            time.sleep(0.004)
        return x


def test_measurement_keeps_the_fastest_path_where_it_may_run(monkeypatch):
    layer = TimedLayer(quick_limit=16)
    evictions = []  # each timed call comes after the caches were evicted (not the warm-up call before them)
    monkeypatch.setattr(kernel_plans, "cache_evictor", lambda: lambda: evictions.append(len(layer.calls)))
    plan, times = measure_plan(layer)
    warm_ups = sum(len(timed) for timed in times.values())
    assert len(evictions) == len(layer.calls) - warm_ups > 0
    assert all(plan.path(b) == ("quick" if b <= 16 else "slow") for b in ROW_BUCKETS)
    assert times[16].keys() == {"slow", "quick"} and times[256] == {}  # timed only where there is a choice
    # the default stays unless another path is faster by the margin
    assert choose({"slow": 1.04, "quick": 1.0}, "slow") == "slow"
    assert choose({"slow": 1.06, "quick": 1.0}, "slow") == "quick"
    assert choose({"quick": 1.0}, "slow") == "quick"  # the default may not run at these rows


def test_measured_plans_are_stored_per_machine_and_read_back(isolated_home, monkeypatch):
    layer = TimedLayer()
    first = plan_for(layer, "measured")
    stored = list((isolated_home / "kernels").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["timed|float32|8x8"] == first.to_json()
    kernel_plans._stored.cache_clear()  # a new process: reads the store, measures nothing
    monkeypatch.setattr(kernel_plans, "measure_plan", lambda layer: pytest.fail("measured again"))
    assert plan_for(layer, "measured").choices == first.choices
    assert set(plan_for(layer, "fixed").choices.values()) == {"slow"}


def test_a_stored_plan_naming_an_absent_path_falls_back_to_the_defaults():
    layer = make_linear(qweight(48, 192, 4, 64, sym=True), torch.float32)
    layer.set_row_plan(RowPlan({1: "no-such-kernel"}))
    assert layer._row_plan.choices == {b: layer.default_path(b) for b in ROW_BUCKETS}


def test_the_engine_records_each_shapes_choice(tiny_gptq_artifact, isolated_home):
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.executor.loader import load_runtime_model

    model, tokenizer, _ = load_runtime_model(str(tiny_gptq_artifact))
    engine = Engine(model, tokenizer, EngineConfig(kv_cache_bytes=1 << 22, linear_kernels="fixed"))
    paths = engine.numerics()["linear_paths"]
    assert any(key.startswith("int4-cpu|float32|") for key in paths)
    # the rest: the dense lm_head (tied embedding), whose fp32 GEMM may take the few-rows kernel
    dense = {key: plan for key, plan in paths.items() if not key.startswith("int4-cpu|")}
    assert list(dense) == [f"dense|float32|{model.config.vocab_size}x{model.config.hidden_size}"]
    assert set(next(iter(dense.values())).values()) <= {"blas", "gemv"}
    layer = next(m for m in engine.runner.decoder.modules() if isinstance(m, Int4PackedLinear))
    assert paths[layer.row_plan_key()] == {str(b): layer.default_path(b) for b in ROW_BUCKETS}
    engine = Engine(model, tokenizer, EngineConfig(kv_cache_bytes=1 << 22))  # measured: stored in LLMOPT_HOME
    assert engine.numerics()["linear_kernels"] == "measured" and list((isolated_home / "kernels").glob("*.json"))
    with pytest.raises(ConfigError, match="--linear-kernels must be one of measured, fixed"):
        EngineConfig(linear_kernels="fastest")


def test_dense_fp32_linears_have_blas_gemv_onednn_and_prepacked_paths_and_run_the_planned_one(monkeypatch):
    from torch import nn

    from llmopt.runtime.executor.linear.dense import FusedDenseLinear, fuse_linears

    torch.manual_seed(0)
    parts = [nn.Linear(192, 48, bias=True), nn.Linear(192, 16, bias=False)]  # stacked: q/k/v-like, one bias
    layer = fuse_linears(parts, prepack=True)
    assert type(layer) is FusedDenseLinear and not layer.packed
    # (gemv timed up to 2 rows beside the copy in the AVX-512 builds, 4 in the AVX2 one: FP32_GEMV_ROWS_BESIDE_COPY)
    from llmopt.core.hardware import kernel_isa

    limit = FusedDenseLinear.FP32_GEMV_ROWS_BESIDE_COPY.get(kernel_isa(), 8)
    assert layer.row_paths() == {"blas": None, "gemv": limit, "onednn": None, "prepacked": None}
    assert layer.row_plan_key() == "dense|float32|64x192|prepacked copy"
    for rows in (*ROWS, 32, 300):
        x = torch.randn(rows, 192)
        expected = torch.cat([p(x) for p in parts], dim=-1)
        candidates = layer.candidate_paths(rows, layer.row_paths())
        # beyond gemv's rows the prepacked copy, untimed
        assert candidates == (["blas", "gemv", "prepacked"] if rows <= limit else ["prepacked"])
        assert (layer.default_path(rows) == "prepacked") == (rows > limit)
        for name in layer.row_paths():
            if name != "gemv" or rows <= 8:  # (gemv's kernel takes up to 8 rows a pass)
                torch.testing.assert_close(layer.run_path(name, x), expected, rtol=1e-5, atol=1e-5)
    # the plan decides, per row count, after forward_2d was bound (the decoder binds it at build time)
    calls = []
    ops = cpu_ops()

    class CountingOps:
        def gemv(self, x, w):
            calls.append(x.shape[0])
            return ops.gemv(x, w)

    monkeypatch.setattr(dense, "cpu_ops", lambda: CountingOps())
    forward = layer.forward_2d()
    linear_pointwise, onednn_rows = torch.ops.mkldnn._linear_pointwise, []

    def counting_linear(x, *rest):
        onednn_rows.append(x.shape[0])
        return linear_pointwise(x, *rest)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting_linear, raising=False)
    layer.set_row_plan(RowPlan({1: "gemv", 2: "blas", 4: "gemv", 8: "blas", 16: "prepacked", 64: "onednn",
                                1024: "blas"}))
    for rows in (1, 2, 3, 8, 9, 64, 65):
        x = torch.randn(rows, 192)
        torch.testing.assert_close(forward(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-5)
    assert calls == [1, 3] and onednn_rows == [9, 64] and layer.prepacked_weight is not None
    # a prepacked fp32 head: one path, which forward_2d returns as is
    head = fuse_linears([nn.Linear(192, 48, bias=False)], prepack=True, pack_float32=True)
    assert head.packed and list(head.row_paths()) == ["blas"]
    x = torch.randn(3, 192)
    torch.testing.assert_close(head.forward_2d()(x), head(x))
    monkeypatch.setattr(kernel_plans, "cache_evictor", lambda: pytest.fail("no choice, nothing to time"))
    assert set(measure_plan(head)[0].choices.values()) == {"blas"}


def bf16_reference(parts, x):
    return torch.cat([x.float() @ p.weight.float().t() + (p.bias.float() if p.bias is not None else 0)
                      for p in parts], dim=-1)


@pytest.mark.skipif(not dense._mkldnn_bf16(), reason="no oneDNN bf16 on this CPU")
def test_dense_bf16_linears_run_gemv_on_the_plain_weight_and_oneDNN_on_a_prepacked_copy_for_more_rows():
    """A bf16 weight on CPU is kept plain (gemv: 1-8 rows) and prepacked for oneDNN (faster from 16 rows on an
    AVX-512 BF16 CPU); the copy is freed when the plan runs it at no row count."""
    from torch import nn

    from llmopt.runtime.executor.linear.dense import FusedDenseLinear, fuse_linears

    torch.manual_seed(0)
    parts = [nn.Linear(192, 48, bias=True).to(torch.bfloat16), nn.Linear(192, 16, bias=False).to(torch.bfloat16)]
    layer = fuse_linears(parts, prepack=True)
    assert type(layer) is FusedDenseLinear and not layer.packed and layer.weight.layout == torch.strided
    assert layer.row_paths() == {"blas": None, "gemv": 8, "prepacked": None}
    assert layer.row_plan_key() == "dense|bfloat16|64x192|prepacked copy"
    assert layer.graph_kernels() == {"gemv": ("gemv", [layer.weight], []), "blas": ("linear", [layer.weight], []),
                                     "prepacked": ("onednn_linear", [layer.prepacked_weight], [])}
    for rows in (*ROWS, 32):
        x = torch.randn(rows, 192).to(torch.bfloat16)
        candidates = layer.candidate_paths(rows, layer.row_paths())
        assert candidates == (["blas", "gemv", "prepacked"] if rows <= 8 else ["prepacked"])
        assert layer.default_path(rows) == ("gemv" if rows <= 8 else "prepacked")
        expected = bf16_reference(parts, x)
        for name in candidates:
            got = layer.run_path(name, x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    x = torch.randn(2, 5, 192).to(torch.bfloat16)  # forward: any leading shape, the default path
    torch.testing.assert_close(layer(x).float(), bf16_reference(parts, x), rtol=2e-2, atol=2e-2)
    # a plan running the copy keeps it; one that does not frees it (and the layer then offers no such path)
    layer.set_row_plan(RowPlan({8: "gemv", 16: "prepacked", 1024: "blas"}))
    assert layer.prepacked_weight is not None
    layer.set_row_plan(RowPlan({8: "gemv", 1024: "blas"}))
    assert layer.prepacked_weight is None and "prepacked" not in layer.row_paths()
    assert layer.row_plan_key().endswith("|prepacked copy")  # (what the plan was measured with)
    x = torch.randn(20, 192).to(torch.bfloat16)
    torch.testing.assert_close(layer.forward_2d()(x).float(), bf16_reference(parts, x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_prefill_is_widened_to_fp32_where_onednn_has_no_16bit_gemm(monkeypatch, dtype):
    """On a CPU whose oneDNN cannot multiply 16-bit (AVX2), torch's 16-bit GEMM is a slow reference loop: prefill
    chunks (from ONEDNN_MIN_ROWS rows) take `widened`, the weight widened to fp32 for the call, the sums rounded once
    to the layer's dtype. Where oneDNN has the 16-bit GEMM the path is not offered."""
    from torch import nn

    monkeypatch.setattr(dense, "_mkldnn_16bit", lambda dtype: False)
    monkeypatch.setattr(dense, "_mkldnn_bf16", lambda: False)
    torch.manual_seed(0)
    parts = [nn.Linear(192, 48, bias=True).to(dtype), nn.Linear(192, 16, bias=False).to(dtype)]
    layer = dense.fuse_linears(parts, prepack=True)
    assert layer.prepacked_weight is None and layer.row_paths()["widened"] is None
    minimum = dense.FusedDenseLinear.ONEDNN_MIN_ROWS
    for rows in (*ROWS, minimum - 1, minimum):
        prefill = rows >= minimum
        assert ("widened" in layer.candidate_paths(rows, layer.row_paths())) == prefill
        assert (layer.default_path(rows) == "widened") == prefill
    x = torch.randn(64, 192).to(dtype)
    got = layer.run_path("widened", x)
    assert got.dtype == dtype
    # exactly the fp32 product of the 16-bit values, rounded once
    assert torch.equal(got, bf16_reference(parts, x).to(dtype))
    torch.testing.assert_close(layer(x).float(), bf16_reference(parts, x), rtol=2e-2, atol=2e-2)
    layer.set_row_plan(RowPlan({8: "blas", 1024: "widened"}))
    assert torch.equal(layer.forward_2d()(x), got)
    monkeypatch.setattr(dense, "_mkldnn_16bit", lambda dtype: True)
    assert "widened" not in dense.fuse_linears(parts, prepack=True).row_paths()


def test_a_bf16_weight_gets_no_prepacked_copy_where_memory_is_short(monkeypatch):
    """A second copy of every bf16 weight would not fit beside a large model: without room the layer keeps the
    plain weight alone (gemv up to 8 rows, then oneDNN's GEMM on it), under a plan key of its own."""
    from torch import nn

    from llmopt.runtime.executor import host_memory

    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: 0)
    layer = dense.fuse_linears([nn.Linear(192, 48, bias=False).to(torch.bfloat16)], prepack=True)
    assert layer.prepacked_weight is None and not layer.with_prepacked_copy
    assert "prepacked" not in layer.row_paths() and layer.row_plan_key() == "dense|bfloat16|48x192"
    gemv = "gemv" if cpu_ops() is not None else "blas"
    prefill = "widened" if not dense._mkldnn_16bit(torch.bfloat16) else "blas"  # (AVX2: no oneDNN bf16 GEMM)
    assert [layer.default_path(rows) for rows in (1, 8, 9, 512)] == [gemv, gemv, "blas", prefill]
    x = torch.randn(9, 192).to(torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), x.float() @ layer.weight.float().t(), rtol=2e-2, atol=2e-2)
    # fp32 without its copy: gemv up to 8 rows, oneDNN's linear on the plain weight only for prefill-sized steps
    fp32 = dense.fuse_linears([nn.Linear(192, 48, bias=False)], prepack=True)
    assert fp32.prepacked_weight is None and fp32.row_paths() == {"blas": None, "onednn": None} | (
        {"gemv": 8} if cpu_ops() is not None else {})
    for rows in ROWS:
        candidates = fp32.candidate_paths(rows, fp32.row_paths())
        assert ("onednn" in candidates) == (rows >= dense.FusedDenseLinear.ONEDNN_MIN_ROWS > 16)
        assert ("gemv" in candidates) == (rows <= 8 and cpu_ops() is not None)


def test_room_for_a_second_copy_keeps_half_the_host_memory_available(monkeypatch):
    import psutil

    from llmopt.runtime.executor import host_memory

    total = psutil.virtual_memory().total
    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: int(total * 0.75))
    assert host_memory.room_for_second_copy(int(total * 0.25))
    assert not host_memory.room_for_second_copy(int(total * 0.25) + 1)
    monkeypatch.undo()
    monkeypatch.setattr(host_memory, "cgroup_memory_headroom", lambda: 1 << 20)  # a container with 1 MiB left
    assert host_memory.host_available_bytes() == 1 << 20 and not host_memory.room_for_second_copy(1)
