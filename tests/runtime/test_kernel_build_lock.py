"""A kernel build killed midway leaves torch's lock file behind; no later process may wait on it forever."""

import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from llmopt.core.hardware import supported_kernel_isas
from llmopt.runtime.executor.kernels import build_lock, cpu_ops
from llmopt.runtime.executor.kernels.build_lock import OWN_LOCK, TORCH_LOCK, exclusive_build
from tests.waits import limit, output_of, wait_until

pytestmark = pytest.mark.skipif(build_lock.fcntl is None, reason="flock is POSIX")


def holder(folder, seconds=600) -> subprocess.Popen:
    """Another process in the middle of a build: it holds the folder (and torch's lock file) until killed."""
    code = ("import sys, time; from pathlib import Path\n"
            "from llmopt.runtime.executor.kernels.build_lock import exclusive_build\n"
            f"with exclusive_build({str(folder)!r}):\n"
            f"    Path({str(folder)!r}, 'lock').touch(); print('building', flush=True); time.sleep({seconds})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_until(lambda: (folder / TORCH_LOCK).exists(), limit(60), "the holder's build starting", proc)
    return proc


def test_a_lock_file_left_by_a_dead_build_is_removed(tmp_path):
    (tmp_path / TORCH_LOCK).touch()  # a build killed before torch removed its lock
    with exclusive_build(tmp_path, wait_s=limit(10)):
        assert not (tmp_path / TORCH_LOCK).exists()
        assert (tmp_path / OWN_LOCK).read_text() == str(os.getpid())


def test_a_live_build_is_waited_for_with_a_bound_and_its_lock_kept(tmp_path):
    proc = holder(tmp_path)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=f"another process \\(PID {proc.pid}\\) has been building"), \
                exclusive_build(tmp_path, wait_s=1.0):
            pass
        assert time.monotonic() - start < limit(30)
        assert (tmp_path / TORCH_LOCK).exists()  # (a live build's lock is not touched)
    finally:
        output_of(proc)


def test_the_build_goes_on_once_the_builder_is_killed(tmp_path):
    proc = holder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup runs: torch's lock file stays
    proc.wait(timeout=limit(30))
    assert (tmp_path / TORCH_LOCK).exists()
    with exclusive_build(tmp_path, wait_s=limit(30)):
        assert not (tmp_path / TORCH_LOCK).exists()


def test_loading_the_kernels_does_not_wait_on_a_dead_builds_lock(tmp_path, monkeypatch):
    """_load through torch's protocol (a stand-in for the compiler: try the lock file, else wait while it exists)
    over a build folder where a killed build left the lock."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / "llmopt_cpu_kernels_scalar"
    folder.mkdir()
    (folder / TORCH_LOCK).touch()
    built = []

    def load(name, **kwargs):
        baton = FileBaton(os.path.join(cpp_extension._get_build_directory(name, False), "lock"))
        if not baton.try_acquire():
            raise AssertionError("torch's loader would have waited on the dead build's lock forever")
        built.append(name)
        baton.release()

    monkeypatch.setattr(cpp_extension, "load", load)
    cpu_ops._load.__wrapped__("scalar")
    assert built == ["llmopt_cpu_kernels_scalar"] and not (folder / TORCH_LOCK).exists()


def build_script():
    """scripts/build_kernels.py's namespace (the Makefile runs it in the background while pip installs)."""
    return runpy.run_path(str(Path(__file__).parents[2] / "scripts" / "build_kernels.py"), run_name="build_kernels")


def test_the_prebuild_script_builds_this_cpus_kernels_first_then_the_lower_ones(monkeypatch, capsys):
    script = build_script()
    asked = []
    monkeypatch.setitem(script["main"].__globals__, "kernel_isa", lambda: "avx512")
    monkeypatch.setitem(script["main"].__globals__, "supported_kernel_isas",
                        lambda: ["scalar", "avx2", "avx512", "avx512_bf16"])
    monkeypatch.setitem(script["main"].__globals__, "cpu_ops",
                        lambda isa: asked.append(isa) or (None if isa == "avx2" else object()))
    assert script["main"]() == 1  # one build unavailable: said, and the exit status says so
    assert asked == ["avx512", "avx512_bf16", "avx2", "scalar"]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == asked and "avx2: unavailable" in lines[2]


@pytest.mark.skipif(cpu_ops.cpu_ops() is None, reason="the compiled CPU kernels are not available here")
def test_the_prebuild_script_leaves_every_build_of_this_cpu_loadable(capsys):
    assert build_script()["main"]() == 0
    out = capsys.readouterr().out
    assert all(f"{isa}: built" in out for isa in supported_kernel_isas()), out
