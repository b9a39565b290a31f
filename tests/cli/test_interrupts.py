"""Kills and Ctrl-C, through the real `llmopt` entry point in a subprocess: a run stopped mid-way leaves nothing
at its output path, says so, and a later run cleans up what a killed one left.

The child runs the CLI with one library function wrapped so that it signals (a file appears) and then waits at a
known point; the test then sends the signal. Nothing else of the command is changed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmopt.cli.main import app
from tests.waits import communicate, wait_until

CHILD = """
import signal, sys, time
from pathlib import Path
# Ctrl-C as in a terminal: a shell's background job (how CI may run us) inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
import {module} as target

ready = Path({ready!r})
original = target.{function}

def wrapped(*args, **kwargs):
    result = original(*args, **kwargs) if {after} else None
    ready.write_text("ready")
    time.sleep(120)
    return result

target.{function} = wrapped
sys.argv = ["llmopt", *{argv!r}]
from llmopt.cli.main import main
main()
"""


def start_paused(tmp_path: Path, argv: list[str], module: str, function: str, after: bool) -> subprocess.Popen:
    """Start `llmopt ARGV` whose `module.function` pauses (after running, when `after`); return once paused."""
    ready = tmp_path / "ready"
    code = CHILD.format(module=module, function=function, ready=str(ready), argv=argv, after=after)
    env = {**os.environ, "LLMOPT_HOME": str(tmp_path / "home")}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    wait_until(ready.exists, 300, "the child reaching its pause", child)
    return child


def quantize_args(model: Path, out: Path) -> list[str]:
    return ["quantize", str(model), "-o", str(out), "--method", "gptq", "--group-size", "32", "--calib", "pystdlib",
            "--num-samples", "2", "--seqlen", "16"]


def test_ctrl_c_during_calibration_says_nothing_was_written(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    child = start_paused(tmp_path, quantize_args(tiny_llama_dir, out), "llmopt.core.datasets",
                         "calibration_samples", after=False)
    child.send_signal(signal.SIGINT)
    _, stderr = communicate(child, 120, "the child after the signal")
    assert child.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == f"interrupted; nothing was written to {out}"
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_sigterm_unwinds_like_ctrl_c(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    child = start_paused(tmp_path, quantize_args(tiny_llama_dir, out), "llmopt.formats.artifact", "write_json",
                         after=True)  # the artifact half written in its temporary folder
    child.send_signal(signal.SIGTERM)
    _, stderr = communicate(child, 120, "the child after the signal")
    assert child.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == f"terminated; nothing was written to {out}"
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # removed on the way out


def test_kill_during_write_leaves_nothing_and_the_next_run_cleans_up(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    # paused after the artifact's config.json is written into the temporary folder, before the rename
    child = start_paused(tmp_path, quantize_args(tiny_llama_dir, out), "llmopt.formats.artifact", "write_json",
                         after=True)
    temporaries = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(temporaries) == 1 and any(temporaries[0].iterdir())  # a partly written folder
    child.send_signal(signal.SIGKILL)
    communicate(child, 120, "the child after SIGKILL")
    assert not out.exists()  # the output path never holds a partial artifact
    assert temporaries[0].exists()  # SIGKILL runs no cleanup: the next run must
    result = CliRunner().invoke(app, quantize_args(tiny_llama_dir, out))
    assert result.exit_code == 0, result.output
    assert (out / "llmopt.json").is_file() and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_temporary_of_a_running_process_is_left_alone(tiny_llama_dir, tmp_path):
    """Only temporaries whose process is gone are stale: one a live run is writing is not touched."""
    live = tmp_path / f".out.tmp-{os.getpid()}-0123abcd"
    live.mkdir()
    dead = tmp_path / ".out.tmp-999999999-0123abcd"
    dead.mkdir()
    other = tmp_path / ".other.tmp-999999999-0123abcd"  # another output's: not ours to clean now
    other.mkdir()
    from llmopt.core.io import remove_stale_temporaries

    remove_stale_temporaries(tmp_path / "out")
    assert live.exists() and not dead.exists() and other.exists()


@pytest.mark.parametrize("text", [
    # what safetensors raises when the disk fills, as save_tensors sees it (both of its versions' texts)
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })',
    "Error while serializing: I/O error: No space left on device (os error 28)",
])
def test_a_full_disk_is_one_line_and_leaves_nothing(tiny_llama_dir, tmp_path, monkeypatch, text):
    def full(tensors, path, metadata=None):
        raise RuntimeError(text)

    monkeypatch.setattr("safetensors.torch.save_file", full)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, quantize_args(tiny_llama_dir, out))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: No space left on device (") and "nothing was written" in lines[-1], lines
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_full_disk_during_a_gguf_export_is_one_line_and_leaves_nothing(tiny_gptq_artifact, tmp_path, monkeypatch):
    """numpy's short write ("N requested and M written", no errno) on a filesystem with no room left: the full disk
    it is, in one line, and no file or temporary left."""
    import shutil

    import gguf

    def short(self):
        raise OSError("16576 requested and 8512 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**6, 10**6 - 100, 100))
    out = tmp_path / "m.gguf"
    result = CliRunner().invoke(app, ["export", str(tiny_gptq_artifact), "--format", "gguf", "-o", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: No space left on device (") and "nothing was written" in lines[-1], lines
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_signal_the_moment_the_temporary_appears_leaves_nothing(tiny_llama_dir, tmp_path, monkeypatch):
    """SIGTERM landing just after the output's temporary folder is made (before any file is in it): exit 143,
    "nothing was written", and no empty temporary left behind."""
    from llmopt.cli.main import Terminated

    made = Path.mkdir

    def mkdir_then_terminated(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if ".tmp-" in self.name:
            raise Terminated()  # what the SIGTERM handler raises, at the first bytecode after the folder exists

    monkeypatch.setattr(Path, "mkdir", mkdir_then_terminated)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, quantize_args(tiny_llama_dir, out))
    assert result.exit_code == 143, result.output
    assert "terminated; nothing was written" in result.output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_the_rename_into_place_is_not_split_by_a_signal(tmp_path):
    """The renames that put the output in place, and the record that it was written, happen together: a signal
    held until they are done (so "nothing was written" is never said of an output that was)."""
    import signal as signals

    from llmopt.core.io import PENDING_OUTPUTS, atomic_output_dir, check_output_free

    import threading

    final = tmp_path / "out"
    check_output_free(final)
    got = []
    # another thread that does not block signals (a server's, a kernel's): the OS may hand it the signal, and
    # Python still runs the handler in the main thread, so masking the main thread alone held nothing
    idle = threading.Event()
    threading.Thread(target=idle.wait, daemon=True).start()
    previous = signals.signal(signals.SIGTERM, lambda *a: got.append(final.exists() and final not in PENDING_OUTPUTS))
    try:
        with atomic_output_dir(final) as tmp:
            (tmp / "a.txt").write_text("x")
            real_replace = os.replace

            def replace_then_signal(src, dst):
                real_replace(src, dst)
                os.kill(os.getpid(), signals.SIGTERM)  # arrives between the rename and the record

            os.replace = replace_then_signal
        os.replace = real_replace
    finally:
        os.replace = real_replace
        signals.signal(signals.SIGTERM, previous)
        idle.set()
    assert got == [True]  # the handler ran once, after the output was in place and recorded
