"""The capacity planner's formulas against cases computed by hand, and `llmopt plan` through the CLI."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.core.errors import ConfigError
from llmopt.planner import Deployment, HardwareSpec, ModelShape, PlanWorkload, Slo, predict, recommend
from llmopt.planner.roofline import Instance
from llmopt.planner.shape import weight_scheme

LLAMA_8B = Path(__file__).resolve().parents[1] / "data" / "llama-3.1-8b-config.json"
# Llama-2-7B's shape: MHA (32 KV heads), an untied 32,000 vocabulary
LLAMA_7B = ModelShape("llama-2-7b", hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128, intermediate=11008,
                      vocab=32000, tied_embeddings=False, max_context=4096)
# a device with round numbers and no efficiency loss: 1,000 GB/s, 100 TFLOP/s in bf16, 100 GB/s links of 5 us
ROUND = HardwareSpec(name="round", memory_gib=80, bandwidth_gb_s=1000, flops_tflops={"bf16": 100},
                     compute_efficiency=1, bandwidth_efficiency=1, link_gb_s=100, link_latency_us=5, memory_utilization=1)


def test_a_7b_model_s_parameters_and_kv_bytes():
    layer = 4096 * (2 * 4096 + 2 * 4096) + 3 * 4096 * 11008  # q, o + k, v (MHA); gate, up, down
    assert LLAMA_7B.layer_params == layer == 202_375_168
    assert LLAMA_7B.params == 32 * layer + 2 * 32000 * 4096 == 6_738_149_376  # Llama-2-7B's 6.74 B
    assert LLAMA_7B.kv_bytes_per_token("bf16") == 2 * 32 * 32 * 128 * 2 == 524_288  # 0.5 MiB per token
    assert LLAMA_7B.kv_bytes_per_token("int8") == 2 * 32 * 32 * (128 + 4)  # one fp32 scale per token and head
    assert weight_scheme("int4").bytes_per_weight == (4 + 20 / 128) / 8  # fp16 scale + 4-bit zero per 128


def test_batch_1_decode_reads_every_weight_once_at_the_bandwidth():
    weights = 32 * 202_375_168 * 2 + 32000 * 4096 * 2  # bf16 decoder linears + the lm_head
    one = Instance(LLAMA_7B, ROUND, weight_scheme("bf16"), "bf16")
    assert one.decode_step(1, 0) == pytest.approx(weights / 1e12)  # 13.2 ms
    # 1,000 cached tokens add their keys and values to the bytes read
    assert one.decode_step(1, 1000) == pytest.approx((weights + 1000 * 524_288) / 1e12)
    # int4: 0.52 bytes per decoder weight, the lm_head still in 16 bits
    int4 = Instance(LLAMA_7B, ROUND, weight_scheme("int4"), "bf16")
    assert int4.decode_step(1, 0) == pytest.approx((32 * 202_375_168 * 0.51953125 + 32000 * 4096 * 2) / 1e12)


def test_two_tensor_parallel_ranks_halve_the_bytes_and_add_two_all_reduces_per_layer():
    weights = 32 * 202_375_168 * 2 + 32000 * 4096 * 2
    # a ring all-reduce of [1, 4096] bf16 over 2 ranks moves 2 (2 - 1) / 2 x 8,192 bytes, after 5 us
    all_reduce = 5e-6 + 8192 / 100e9
    two = Instance(LLAMA_7B, ROUND, weight_scheme("bf16"), "bf16", tp=2)
    assert two.all_reduce_time(1) == pytest.approx(all_reduce)
    assert two.decode_step(1, 0) == pytest.approx(weights / 2 / 1e12 + 64 * all_reduce)
    assert two.weight_memory() == pytest.approx(LLAMA_7B.stored_bytes(weight_scheme("bf16")) / 2)


def test_prefill_is_compute_bound():
    one = Instance(LLAMA_7B, ROUND, weight_scheme("bf16"), "bf16")
    # 1,000 tokens: 2 FLOPs per decoder weight each, attention over 500 tokens on average, the lm_head for one row
    flops = 1000 * (2 * 32 * 202_375_168 + 4 * 32 * 32 * 128 * 500) + 2 * 32000 * 4096
    assert one.prefill_time(1000) == pytest.approx(flops / 100e12)  # 134 ms, well above the 13 ms read


def test_pipeline_stages_overlap_their_micro_batches():
    """PP=2, batch 2: two micro-batches of one sequence, (2 + 2 - 1) stage-times of half the layers each."""
    two = Instance(LLAMA_7B, ROUND, weight_scheme("bf16"), "bf16", pp=2)
    stage = 32 * 202_375_168 * 2 / 2 / 1e12  # half the decoder's weights
    head = 32000 * 4096 * 2 / 1e12
    transfer = 5e-6 + 4096 * 2 / 100e9
    assert two.decode_step(2, 0) == pytest.approx(3 * stage + 2 * transfer + head)


def test_the_8b_config_in_the_test_data_and_a_recommendation_that_meets_the_slo():
    shape = ModelShape.from_path(LLAMA_8B)
    assert (shape.layers, shape.kv_heads, shape.vocab) == (32, 8, 128256)
    assert shape.params == pytest.approx(8.03e9, rel=0.01)  # Llama-3.1-8B
    workload, slo = PlanWorkload("w", 1024, 128, concurrency=64), Slo(ttft_ms=200, tpot_ms=50)
    best, table = recommend(shape, ROUND, workload, slo, schemes=("bf16", "int4"), kv_dtypes=("bf16",))
    assert best is not None and best.meets_slo
    assert all(p.deployment.devices >= best.deployment.devices for p in table if p.meets_slo)
    # on one device the 64 prompts' prefills (1,024 tokens: 1.5 ms of FLOPs each) come into the decode steps: the
    # mean TPOT passes 50 ms, so two devices it is
    one = predict(shape, ROUND, workload, slo, Deployment("int4", "bf16", batch=64))
    assert one.fits and one.tpot_ms > 50 and best.deployment.devices == 2
    # int4 reads a third of bf16's bytes: a faster decode step at the same batch
    bf16 = predict(shape, ROUND, workload, slo, Deployment("bf16", "bf16", batch=64))
    int4 = predict(shape, ROUND, workload, slo, Deployment("int4", "bf16", batch=64))
    assert int4.tpot_ms < bf16.tpot_ms and int4.memory_per_device_gib < bf16.memory_per_device_gib


def test_a_deployment_that_does_not_fit_never_meets_the_slo():
    small = HardwareSpec(**{**ROUND.model_dump(), "name": "small", "memory_gib": 8})
    p = predict(LLAMA_7B, small, PlanWorkload("w", 128, 128, 1), Slo(), Deployment("bf16", "bf16"))
    assert not p.fits and not p.meets_slo and p.goodput_rps == 0  # 12.6 GiB of weights in 8


def test_a_rate_adds_replicas_and_pd_splits_prefill_from_decode():
    workload = PlanWorkload("w", 512, 128, concurrency=32, rate=1000.0)
    best, _ = recommend(LLAMA_7B, ROUND, workload, Slo(ttft_ms=500, tpot_ms=100), schemes=("bf16",),
                        kv_dtypes=("bf16",))
    assert best is not None and best.requests_per_s >= 1000 and best.deployment.instances > 1
    colocated = predict(LLAMA_7B, ROUND, workload, Slo(), Deployment(batch=32))
    split = predict(LLAMA_7B, ROUND, workload, Slo(), Deployment(batch=32, pd=(1, 1)))
    assert split.tpot_ms < colocated.tpot_ms  # no prefill in the decode steps


def test_slo_parsing_and_bad_input():
    assert Slo.parse("ttft=200,tpot=50") == Slo(200, 50)
    assert Slo.parse("tpot=20").ttft_ms == float("inf")
    with pytest.raises(ConfigError, match="is not ttft or tpot"):
        Slo.parse("latency=3")
    dense = {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 16,
             "vocab_size": 32}
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        ModelShape.from_config({**dense, "num_local_experts": 8})
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        ModelShape.from_config({**dense, "n_routed_experts": 4, "first_k_dense_replace": 1})
    # expert fields named, every layer dense (tiny-random-deepseek; Qwen-MoE's mlp_only_layers): planned
    assert ModelShape.from_config({**dense, "n_routed_experts": 4, "first_k_dense_replace": 2}).layers == 2
    assert ModelShape.from_config({**dense, "num_experts": 4, "mlp_only_layers": [0, 1]}).layers == 2


def test_cli_plan_prints_a_table_and_a_recommendation():
    result = CliRunner().invoke(app, ["plan", str(LLAMA_8B), "--hardware", "h200", "--workload", "sharegpt",
                                      "--slo", "ttft=200,tpot=50"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "recommended:" in result.output and "h200" in result.output
    as_json = CliRunner().invoke(app, ["plan", str(LLAMA_8B), "--hardware", "h100", "--workload", "long",
                                       "--slo", "tpot=50", "--schemes", "bf16", "--json"])
    data = json.loads(as_json.stdout)
    assert data["recommendation"]["meets_slo"] and data["recommendation"]["deployment"]["scheme"] == "bf16"
    assert data["workload"]["concurrency"] == 64


def test_cli_plan_rejects_bad_input_with_one_line(tmp_path):
    for args, says in ((["--slo", "ttft=fast"], "not a number"), (["--hardware", "tpu"], "unknown --hardware"),
                       (["--workload", "nope"], "unknown --workload"), (["--schemes", "int3"], "weight scheme")):
        result = CliRunner().invoke(app, ["plan", str(LLAMA_8B), *args])
        assert result.exit_code == 1 and says in result.output, result.output
    spec = tmp_path / "gpu.json"
    spec.write_text(json.dumps({"memory_gib": 48, "bandwidth_gb_s": 864, "flops_tflops": {"bf16": 181},
                                "link_gb_s": 32, "link_latency_us": 10, "colour": "green"}))
    result = CliRunner().invoke(app, ["plan", str(LLAMA_8B), "--hardware-file", str(spec)])
    assert result.exit_code == 1 and "colour" in result.output


def test_this_cpu_is_a_spec_from_its_measured_rates():
    from llmopt.core.hardware import measured_rates
    from llmopt.planner import hardware_spec

    cpu, rates = hardware_spec("cpu"), measured_rates()
    assert cpu.kind == "cpu" and cpu.bandwidth_gb_s == pytest.approx(rates.bandwidth / 1e9)
    assert cpu.flops("fp32") == pytest.approx(rates.gemm_fp32 * cpu.compute_efficiency)
    # ranks on one CPU divide it: two tensor-parallel ranks are no faster at reading the weights than one process
    one = Instance(LLAMA_7B, cpu, weight_scheme("fp32"), "fp32")
    two = Instance(LLAMA_7B, cpu, weight_scheme("fp32"), "fp32", tp=2)
    assert two.decode_step(1, 0) > one.decode_step(1, 0)


DENSE_CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
                "vocab_size": 100, "max_position_embeddings": 512}
GPU_SPEC = {"memory_gib": 48, "bandwidth_gb_s": 864, "flops_tflops": {"bf16": 181}, "link_gb_s": 32,
            "link_latency_us": 10}


@pytest.mark.parametrize("name, content, says", [
    # hardware files: not text, empty, not a mapping, strings, zero / negative / NaN / infinite values, repeated
    # keys, keys the help names that the schema lacked
    ("hw.json", b"\x00\x01\xff", "not a UTF-8 text file"),
    ("hw.json", b"", "the file is empty"),
    ("hw.json", b"[1, 2]", "holds a list, not a mapping"),
    ("hw.json", json.dumps({**GPU_SPEC, "memory_gib": "lots"}).encode(), "memory_gib"),
    ("hw.json", json.dumps({**GPU_SPEC, "memory_gib": 0}).encode(), "memory_gib"),
    ("hw.json", json.dumps({**GPU_SPEC, "flops_tflops": {"bf16": -5}}).encode(), "flops_tflops.bf16"),
    ("hw.json", json.dumps({**GPU_SPEC, "bandwidth_gb_s": float("nan")}).encode(), "finite"),
    ("hw.json", json.dumps({**GPU_SPEC, "link_gb_s": float("inf")}).encode(), "finite"),
    ("hw.yaml", b"memory_gib: 48\nmemory_gib: 64\n", "duplicate key 'memory_gib'"),
    ("hw.json", b'{"memory_gib": 48, "memory_gib": 64}', "duplicate key 'memory_gib'"),
    ("hw.json", json.dumps({**GPU_SPEC, "efficiencies": 0.5}).encode(), "the keys are name, kind, memory_gib"),
])
def test_cli_plan_validates_its_hardware_file(tmp_path, name, content, says):
    spec = tmp_path / name
    spec.write_bytes(content)
    result = CliRunner().invoke(app, ["plan", str(LLAMA_8B), "--hardware-file", str(spec)])
    assert result.exit_code == 1 and says in result.output and "Traceback" not in result.output, result.output


def test_every_hardware_key_the_help_names_is_accepted(tmp_path):
    """The help and the schema agree: a file using every optional key it documents plans."""
    spec = tmp_path / "gpu.yaml"
    spec.write_text(json.dumps({**GPU_SPEC, "name": "g", "kind": "gpu", "compute_efficiency": 0.5,
                                "bandwidth_efficiency": 0.7, "step_overhead_ms": 0.2, "layer_overhead_us": 1,
                                "activation_dtype": "bf16", "max_devices": 4, "memory_utilization": 0.8,
                                "source": "a card"}))
    import typer.main

    from llmopt.planner.device_specs import HardwareSpec

    command = typer.main.get_command(app).commands["plan"]
    documented = next(p.help for p in command.params if p.name == "hardware_file")
    assert all(key in documented for key in HardwareSpec.model_fields), documented
    result = CliRunner().invoke(app, ["plan", str(LLAMA_8B), "--hardware-file", str(spec)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("workload, says", [
    ({"input_tokens": -5, "output_tokens": 10}, "input_tokens"),
    ({"input_tokens": 10, "output_tokens": 0}, "output_tokens"),
    ({"input_tokens": 10, "output_tokens": 10, "concurrency": 0}, "concurrency"),
    ({"input_tokens": 10, "output_tokens": 10, "rate": -3}, "rate"),
    ({"input_tokens": "ten", "output_tokens": 10}, "input_tokens"),
    ({"input_tokens": 10, "output_tokens": 10, "speed": 3}, "the keys are input_tokens"),
    ({"input_tokens": 500, "output_tokens": 100}, "exceed tiny's context of 512"),
    ([1, 2], "holds a list"),
])
def test_cli_plan_validates_its_workload_file(tmp_path, workload, says):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(DENSE_CONFIG))
    file = tmp_path / "w.json"
    file.write_text(json.dumps(workload))
    result = CliRunner().invoke(app, ["plan", str(model), "--workload", str(file)])
    assert result.exit_code == 1 and says in result.output, result.output


@pytest.mark.parametrize("change, says", [
    ({"hidden_size": 0}, "hidden_size is 0"),
    ({"num_hidden_layers": -2}, "num_hidden_layers is -2"),
    ({"vocab_size": 1.5}, "vocab_size is 1.5"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"hidden_size": 66}, "does not divide into num_attention_heads 4"),
])
def test_cli_plan_validates_the_model_config(tmp_path, change, says):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps({**DENSE_CONFIG, **change}))
    result = CliRunner().invoke(app, ["plan", str(model)])
    assert result.exit_code == 1 and says in result.output, result.output


@pytest.mark.parametrize("args, says", [
    (["--rows", "0"], "--rows"), (["--rows", "-5"], "--rows"), (["--slo", "ttft=nan"], "above 0"),
    (["--slo", "tpot=-1"], "above 0"), (["--rate", "nan"], "above 0"), (["--rate", "inf"], "above 0"),
    (["--rate", "-1"], "above 0"), (["--rate", "0"], "above 0"),
])
def test_cli_plan_validates_its_options(args, says):
    result = CliRunner().invoke(app, ["plan", str(LLAMA_8B), *args])
    assert result.exit_code in (1, 2) and says in result.output, result.output
