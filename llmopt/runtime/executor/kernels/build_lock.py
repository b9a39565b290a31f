"""One build of the compiled CPU kernels at a time, and no process waiting forever on a build that died.

torch's extension loader guards a build folder with a `lock` file it creates and removes itself (FileBaton): a
builder killed mid-build (SIGKILL, the OOM killer, a CI time limit; Ctrl-C runs torch's cleanup) leaves the file
behind, and every later process then waits on it without end and without a word. Before torch's loader runs,
`exclusive_build(folder)` takes an flock on a file of its own in the same folder. The OS drops an flock when its
holder dies, so whoever holds it knows no live llmopt process is building there: a `lock` file found then is a dead
build's, and is removed. Waiting for a live builder is logged once and bounded (BUILD_WAIT_S)."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # (not POSIX: torch's own lock file alone)
    fcntl = None

log = logging.getLogger(__name__)

BUILD_WAIT_S = 1200.0  # the longest wait for another process's build (one build takes 1-4 min on 2 cores)
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's lock file in the build folder
OWN_LOCK = "llmopt-build.lock"  # flocked by the builder; holds its PID (for the messages)


@contextmanager
def exclusive_build(folder: str | Path, wait_s: float = BUILD_WAIT_S, poll_s: float = 0.2):
    """Hold the build folder against other llmopt processes; clear torch's lock file if a dead build left it.
    Raises TimeoutError when another live process holds the folder for longer than wait_s."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(folder / OWN_LOCK, "a+") as handle:
        _acquire(handle, folder, wait_s, poll_s)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            stale = folder / TORCH_LOCK
            if stale.exists():  # (no live llmopt process builds here: a dead build's)
                log.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _acquire(handle, folder: Path, wait_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"another process ({_holder(folder)}) has been building llmopt's CPU kernels in {folder} for "
                    f"over {wait_s:.0f} s: let it finish, or stop it and run again") from None
            if not told:
                log.warning("waiting for another process (%s) to finish building llmopt's CPU kernels in %s",
                            _holder(folder), folder)
                told = True
            time.sleep(poll_s)


def _holder(folder: Path) -> str:
    try:
        pid = (folder / OWN_LOCK).read_text().strip()
    except OSError:
        pid = ""
    return f"PID {pid}" if pid else "PID unknown"
