"""Bounded waits for tests that start processes or wait on I/O.

Every wait in the suite has a limit, so a slow or stuck machine gives a failure with a message instead of a run
that sits until CI's time limit. The limits guard against hangs, they measure nothing: they are generous
(minutes) and scaled by one factor, `LLMOPT_TEST_WAIT_SCALE` (default 1; e.g. 3 on a machine known to be busy).
pytest-timeout (pyproject's `timeout`) is the last guard behind them.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

WAIT_SCALE = float(os.environ.get("LLMOPT_TEST_WAIT_SCALE", "1") or 1)


def limit(seconds: float) -> float:
    """A wait's limit in seconds, scaled for the machine."""
    return seconds * WAIT_SCALE


def output_of(proc: subprocess.Popen, grace: float = 10.0) -> str:
    """Kill `proc` if it still runs, then its captured output (stdout + stderr; empty if not piped): never waits
    for EOF from a live process."""
    if proc.poll() is None:
        proc.kill()
    try:
        out, err = proc.communicate(timeout=limit(grace))
    except subprocess.TimeoutExpired:
        return "<no output: the process did not exit after SIGKILL>"
    text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                   for part in (out, err) if part)
    return text[-3000:]


def wait_until(condition: Callable[[], bool], seconds: float, what: str, proc: subprocess.Popen | None = None,
               poll: float = 0.05) -> None:
    """Poll `condition` until it holds; fail with `what` (and the process's output, killing it) after the scaled
    limit, or at once if `proc` exits first."""
    deadline = time.monotonic() + limit(seconds)
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}:\n{output_of(proc)}")
        if time.monotonic() > deadline:
            tail = f":\n{output_of(proc)}" if proc is not None else ""
            raise AssertionError(f"{what}: not within {limit(seconds):.0f} s{tail}")
        time.sleep(poll)


def wait_exit(proc: subprocess.Popen, seconds: float, what: str) -> int:
    """The process's exit code once it exits; killed and failed with its output after the scaled limit."""
    try:
        return proc.wait(limit(seconds))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what}: still running after {limit(seconds):.0f} s:\n{output_of(proc)}") from None


def communicate(proc: subprocess.Popen, seconds: float, what: str) -> tuple[str, str]:
    """(stdout, stderr) once the process exits; killed and failed with its output after the scaled limit."""
    try:
        return proc.communicate(timeout=limit(seconds))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what}: still running after {limit(seconds):.0f} s:\n{output_of(proc)}") from None
