"""The suite's bounded waits fail with a message, and never block on a process that is still alive."""

import subprocess
import sys
import time

import pytest

from tests.waits import communicate, wait_exit, wait_until


def sleeper() -> subprocess.Popen:
    code = "import sys, time; print('started', flush=True); time.sleep(600)"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_wait_that_runs_out_fails_with_the_process_output_and_kills_it():
    proc = sleeper()
    start = time.monotonic()
    with pytest.raises(AssertionError, match="(?s)the server answering: not within 1 s.*started"):
        wait_until(lambda: False, 1, "the server answering", proc)
    assert time.monotonic() - start < 30 and proc.poll() is not None  # killed, its output read without hanging


def test_waits_on_exit_and_output_are_bounded_too():
    for wait in (lambda p: wait_exit(p, 1, "the sleeper"), lambda p: communicate(p, 1, "the sleeper")):
        proc = sleeper()
        with pytest.raises(AssertionError, match="the sleeper: still running after 1 s"):
            wait(proc)
        assert proc.poll() is not None


def test_a_process_that_exits_first_is_reported_at_once():
    proc = subprocess.Popen([sys.executable, "-c", "print('bye')"], stdout=subprocess.PIPE)
    with pytest.raises(AssertionError, match="(?s)exited \\(0\\) before the pause.*bye"):
        wait_until(lambda: False, 60, "the pause", proc)
