"""Hardware detection and the choices that follow (kernel ISA, the dtype `auto` resolves to, peaks), on the CPU
this runs on and on CPUs described by a fake /proc/cpuinfo: an AVX2-only AMD EPYC, a Sapphire Rapids with AMX,
an Arm server with BF16."""

import json
import os
import subprocess
import sys

import pytest
import torch

from llmopt.core import hardware
from llmopt.core.errors import ConfigError
from tests.waits import limit

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13 64-Core Processor
stepping\t: 1
cpu MHz\t\t: 2450.000
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13 64-Core Processor
physical id\t: 0
core id\t\t: 1
flags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2
"""
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
cpu MHz\t\t: 2000.000
flags\t\t: avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
SKYLAKE = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Gold 6148
flags\t\t: avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
"""
SIMULATION_VARIABLES = ("LLMOPT_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
REAL_MEASURED_RATES = hardware.measured_rates


def rates(fp32: float, bf16: float) -> hardware.MeasuredRates:
    return hardware.MeasuredRates(bandwidth=20e9, gemm_fp32=fp32, gemm_bf16=bf16, threads=2, measured_at="test")


@pytest.fixture
def fake_cpu(monkeypatch):
    """fake_cpu(cpuinfo_text, arch, fp32=..., bf16=...): this process sees that CPU, with those measured GEMM
    rates (bf16 faster by default, as with AMX), until the test ends."""
    for name in SIMULATION_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def install(text: str, arch: str = "x86_64", fp32: float = 1e11, bf16: float = 3e11):
        real_read = hardware._read
        monkeypatch.setattr(hardware, "_read", lambda path: text if path == "/proc/cpuinfo" else real_read(path))
        monkeypatch.setattr(hardware.platform, "machine", lambda: arch)
        monkeypatch.setattr(hardware, "measured_rates", lambda refresh=False: rates(fp32, bf16))
        hardware.cpu_info.cache_clear()

    yield install
    hardware.cpu_info.cache_clear()


def test_avx2_only_epyc_computes_in_fp32(fake_cpu):
    fake_cpu(EPYC_AVX2)
    info = hardware.cpu_info()
    assert info.vendor == "AuthenticAMD" and "EPYC" in info.model and info.mhz == 2450.0
    assert info.signature == "family 25, model 1, stepping 1"  # Zen 3, which the model name alone may not say
    assert info.features == {"avx2", "fma", "f16c"} and info.physical_cores == min(2, info.logical_cpus)
    assert hardware.kernel_isa() == "avx2"
    assert hardware.supported_kernel_isas() == ["scalar", "avx2"]
    assert not hardware.native_bf16()
    assert hardware.resolve_dtype("auto") == "float32"
    assert hardware.resolve_dtype("bfloat16") == "bfloat16"  # explicit choices pass through...
    assert "slow" in hardware.dtype_note("bfloat16")  # ...with a one-line warning
    assert hardware.dtype_note("auto") == "dtype auto -> float32 (no bf16 units; avx2)"
    assert hardware.dtype_note("float32") is None
    assert hardware.flops_per_cycle(torch.float32) == 32 and hardware.flops_per_cycle(torch.bfloat16) == 32
    assert "AMD EPYC" in hardware.cpu_line() and "kernels avx2, auto dtype float32" in hardware.cpu_line()


def test_sapphire_rapids_computes_in_bf16_on_amx(fake_cpu):
    fake_cpu(SAPPHIRE_RAPIDS)
    assert hardware.cpu_info().signature == ""  # (its fake /proc/cpuinfo gives no family)
    assert hardware.kernel_isa() == "avx512_bf16"
    assert hardware.native_bf16() and hardware.resolve_dtype("auto") == "bfloat16"
    assert hardware.dtype_note("bfloat16") is None
    assert hardware.dtype_note("auto") == "dtype auto -> bfloat16 (bf16 units: amx_bf16 avx512_bf16)"
    assert hardware.flops_per_cycle(torch.bfloat16) == 1024 and hardware.flops_per_cycle(torch.float32) == 64
    assert hardware.theoretical_flops(torch.float32, threads=1) == pytest.approx(2.0e9 * 64)


def test_bf16_units_that_trail_fp32_gemms_compute_in_fp32(fake_cpu):
    # AVX512_BF16 without AMX: oneDNN's bf16 GEMMs measured slower than MKL's fp32 ones
    fake_cpu(SAPPHIRE_RAPIDS.replace(" amx_bf16 amx_tile amx_int8", ""), fp32=2.7e11, bf16=1.7e11)
    assert hardware.native_bf16() and hardware.kernel_isa() == "avx512_bf16"
    assert hardware.resolve_dtype("auto") == "float32"
    assert hardware.dtype_note("auto") == ("dtype auto -> float32 (avx512_bf16, but bf16 GEMMs measured slower "
                                           "than fp32 here: 170 vs 270 GFLOP/s)")
    assert "slower than fp32" in hardware.dtype_note("bfloat16")


def test_avx512_without_bf16_units(fake_cpu):
    fake_cpu(SKYLAKE)
    assert hardware.kernel_isa() == "avx512"
    assert hardware.resolve_dtype("auto") == "float32"
    assert hardware.theoretical_flops(torch.float32) is None  # no clock reported: no theoretical peak


def test_arm_with_bf16(fake_cpu):
    fake_cpu(GRAVITON3, arch="aarch64")
    info = hardware.cpu_info()
    assert {"neon", "sve", "bf16", "i8mm", "dotprod"} <= info.features
    assert hardware.kernel_isa() == "scalar" and hardware.supported_kernel_isas() == ["scalar"]
    assert hardware.resolve_dtype("auto") == "bfloat16"


@pytest.mark.parametrize("variables,level", [
    ({"LLMOPT_CPU_ISA": "avx2"}, "avx2"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "avx2"),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "avx2"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "LLMOPT_CPU_ISA": "avx512_bf16"}, "avx512"),
    ({"LLMOPT_CPU_ISA": "scalar", "ONEDNN_MAX_CPU_ISA": "AVX2"}, "scalar"),
    ({"ATEN_CPU_CAPABILITY": "avx512"}, "avx512_bf16"),
])
def test_simulation_variables_cap_the_process(fake_cpu, monkeypatch, variables, level):
    fake_cpu(SAPPHIRE_RAPIDS)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert hardware.kernel_isa() == level
    assert hardware.native_bf16() == (level == "avx512_bf16")
    assert hardware.resolve_dtype("auto") == ("bfloat16" if level == "avx512_bf16" else "float32")
    assert hardware.supported_kernel_isas()[-1] == "avx512_bf16"  # what the CPU can run is unchanged
    if level != "avx512_bf16":
        assert f"simulated as {level}" in hardware.cpu_line()


def test_forced_isa_must_be_known(fake_cpu, monkeypatch):
    fake_cpu(EPYC_AVX2)
    monkeypatch.setenv("LLMOPT_CPU_ISA", "avx1024")
    with pytest.raises(ConfigError, match="LLMOPT_CPU_ISA=avx1024: choose one of scalar, avx2, avx512, avx512_bf16"):
        hardware.kernel_isa()


def test_this_cpu_is_described():
    facts = hardware.hardware_facts(measure=False)
    assert facts["kernel_isa"] in hardware.X86_ISAS
    assert facts["kernel_isa"] in facts["supported_kernel_isas"]
    assert facts["auto_dtype"] in ("float32", "bfloat16")
    assert facts["logical_cpus"] >= 1 and facts["cpu"] == hardware.cpu_line()
    json.dumps(facts)


def test_rates_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(hardware, "_measure_bandwidth", lambda: calls.append("bw") or 20e9)
    monkeypatch.setattr(hardware, "_measure_gemm", lambda dtype: calls.append(str(dtype)) or 1e11)
    first = hardware.measured_rates()
    assert first.bandwidth == 20e9 and first.gemm_fp32 == first.gemm_bf16 == 1e11 and len(calls) == 3
    assert hardware.measured_rates() == first and len(calls) == 3  # from the cache file
    assert len(list((tmp_path / "hardware").glob("*.json"))) == 1
    hardware.measured_rates(refresh=True)
    assert len(calls) == 6


def test_peak_flops_takes_the_measured_rate_when_the_clock_understates_it(fake_cpu, tmp_path, monkeypatch):
    fake_cpu(EPYC_AVX2)
    monkeypatch.setattr(hardware, "measured_rates", REAL_MEASURED_RATES)  # real, over the fake measurements below
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path))
    monkeypatch.setattr(hardware, "_measure_bandwidth", lambda: 20e9)
    monkeypatch.setattr(hardware, "_measure_gemm", lambda dtype: 1e9)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    peak, source = hardware.peak_flops(torch.float32)
    assert peak == pytest.approx(2 * 2.45e9 * 32) and source.startswith("theoretical")
    monkeypatch.setattr(hardware, "_measure_gemm", lambda dtype: 1e12)  # faster than the reported clock allows
    hardware.measured_rates(refresh=True)
    assert hardware.peak_flops(torch.float32) == (1e12, "measured GEMM")


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_forced_isa_loads_that_build_of_the_kernels(isa):
    if isa not in hardware.supported_kernel_isas():
        pytest.skip(f"this CPU cannot execute {isa}")
    code = "from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops; print(cpu_ops().isa())"
    # (the other simulation variables dropped: under a lower cap, as in a simulated-CPU run of the suite, the
    # lowest level wins, test_simulation_variables_cap_the_process checks that; this one LLMOPT_CPU_ISA alone)
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    env["LLMOPT_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=limit(600))
    assert out.stdout.strip() == isa


def test_thp_mode_reads_the_bracketed_choices(tmp_path):
    from llmopt.core.hardware import hardware_facts, thp_mode

    (tmp_path / "enabled").write_text("always [madvise] never\n")
    (tmp_path / "defrag").write_text("always defer defer+madvise [madvise] never\n")
    assert thp_mode(str(tmp_path)) == "madvise, defrag madvise"
    (tmp_path / "enabled").write_text("[never]\n")
    assert thp_mode(str(tmp_path)).startswith("never,")
    assert thp_mode(str(tmp_path / "absent")) is None
    assert "transparent_huge_pages" in hardware_facts(measure=False)
