"""Writing outputs so that an interrupted run leaves nothing behind, and checking them before any work."""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from llmopt.core.errors import ArtifactError, ConfigError

# Outputs checked (check_output_free / check_output_file) and not yet renamed into place: when a run is
# interrupted the CLI names them ("interrupted; nothing was written to OUT").
PENDING_OUTPUTS: list[Path] = []

# Our temporaries are `.NAME.tmp-PID-HEX` / `.NAME.old-PID-HEX` beside NAME; one whose process is gone is stale.
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_location(path: Path, what: str = "output") -> None:
    """Fail early if `path` could not be created: an ancestor is a file, or the nearest existing folder is
    read-only (tried with a real temporary file: permission bits do not tell for root or read-only mounts)."""
    ancestor = _nearest_existing(path.parent)
    if not ancestor.is_dir():
        raise ArtifactError(f"cannot write {what} {path}: {ancestor} is a file, not a folder; choose another path")
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as e:
        raise ArtifactError(f"cannot write {what} {path}: {ancestor} is not writable ({e.strerror}); "
                            "choose another path") from None


def check_output_free(output: str | Path, overwrite: bool = False) -> Path:
    """Fail early (before any expensive work) if the output folder exists and may not be replaced, is a file, or
    cannot be created."""
    output = Path(output).expanduser()
    if output.exists() and not overwrite:
        raise ArtifactError(f"output {output} already exists: choose another path or pass --overwrite")
    if output.exists() and not output.is_dir():
        raise ArtifactError(f"output {output} is a file, not a folder: choose another path")
    check_writable_location(output)
    _pending(output)
    return output


def _pending(path: Path) -> None:
    path = path.resolve()
    if path not in PENDING_OUTPUTS:
        PENDING_OUTPUTS.append(path)


def _done(path: Path) -> None:
    path = Path(path).resolve()
    if path in PENDING_OUTPUTS:
        PENDING_OUTPUTS.remove(path)


def check_output_file(path: str | Path, what: str = "output file") -> Path:
    """Fail early if a file output is an existing folder or cannot be created."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ArtifactError(f"{what} {path} is a folder: give a file path")
    check_writable_location(path, what)
    _pending(path)
    return path


def check_not_inside(output: str | Path, source: str | Path | None, what: str = "input model") -> None:
    """Refuse an output folder that is the input (or inside it): writing it would replace what is being read."""
    if source is None:
        return
    output, source = Path(output).expanduser().resolve(), Path(source).expanduser().resolve()
    if output == source or source in output.parents:
        raise ArtifactError(f"output {output} is the {what} or inside it: choose a path outside {source}")


def remove_stale_temporaries(final: Path) -> None:
    """Delete our temporaries for `final` left by a killed process (its PID no longer runs)."""
    if not final.parent.is_dir():
        return
    for entry in final.parent.glob(f".{glob.escape(final.name)}.*-*-*"):
        match = _TEMP_NAME.match(entry.name)
        if match and match["name"] == final.name and not process_alive(int(match["pid"])):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped by its parent, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie still answers kill(0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _temporary_name(final: Path, kind: str) -> Path:
    return final.parent / f".{final.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextmanager
def atomic_output_dir(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `final`; rename it into place only if the block succeeds.

    >>> with atomic_output_dir("/tmp/out") as tmp:  # doctest: +SKIP
    ...     (tmp / "config.json").write_text("{}")
    """
    final = check_output_free(final, overwrite).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final)
    tmp = _temporary_name(final, "tmp")
    try:  # (the folder is made inside: a signal the moment it appears still removes it)
        tmp.mkdir()
        yield tmp
    except BaseException:
        with signals_deferred():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    with signals_deferred():  # the renames and the record of what was written, whole or not at all
        if final.exists():
            old = _temporary_name(final, "old")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _done(final)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, so the exception their handlers raise cannot land between two
    steps that must happen together: a signal arriving meanwhile is recorded and raised again, to the handler that
    was, once the block is done. (Python runs handlers in the main thread whichever thread the OS picked, so the
    handlers are swapped rather than the signals masked.) Outside the main thread, or for a handler not installed
    from Python, nothing is held."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signum)
        if previous is not None:
            held[signum] = previous
            signal.signal(signum, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        for signum, previous in held.items():
            signal.signal(signum, previous)
        for signum in caught:
            signal.raise_signal(signum)


@contextmanager
def atomic_output_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file name beside `path`; renamed over `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = _temporary_name(path, "tmp")
    try:
        yield tmp
        with signals_deferred():
            os.replace(tmp, path)
            _done(path)
    finally:
        with signals_deferred():
            tmp.unlink(missing_ok=True)


def save_tensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, with an OS failure (a full disk, a quota) raised as the OSError it is: the
    library reports it as its own error type, which the CLI could not tell from a bug."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:
        # (the library's texts: "IoError(Os { code: 28, ... })", or "I/O error: ... (os error 28)")
        code = re.search(r"code: (\d+)|os error (\d+)", str(e))
        if code is None:
            raise
        number = int(code[1] or code[2])
        raise OSError(number, os.strerror(number), str(path)) from e


@contextmanager
def short_writes_as_full_disk(path: str | Path) -> Iterator[None]:
    """A short write reported without an errno (numpy's tofile: "16576 requested and 8512 written") raised as the
    ENOSPC it is when the file's filesystem has no room left for what was requested, so the CLI says so in one
    line; any other error as it came."""
    try:
        yield
    except OSError as e:
        short = re.match(r"(\d+) requested and (\d+) written", str(e)) if e.errno is None else None
        if short is None or shutil.disk_usage(Path(path).parent).free >= int(short[1]) - int(short[2]):
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e


def weights_bytes(folder: str | Path) -> int:
    """Bytes of a model folder's safetensors files (its weights as stored)."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def write_json(path: str | Path, data: Any, indent: int = 2) -> None:
    """Write JSON atomically: into a temporary file beside `path`, renamed over it once complete."""
    write_text(path, json.dumps(data, indent=indent, sort_keys=False, default=str) + "\n")


def write_text(path: str | Path, text: str) -> None:
    """Write a file atomically (a reader sees the old content or the new, never a part)."""
    with atomic_output_file(path) as tmp:
        tmp.write_text(text)


def read_json(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): rewrite or remove it") from None
    except UnicodeDecodeError:
        raise ArtifactError(f"{path} is not a text file: rewrite or remove it") from None


def check_unique_keys(node, path: Path) -> None:
    """Refuse a YAML mapping that repeats a key (YAML lets the later one silently replace the earlier): the
    composed `node`'s mappings, at any depth, with the line of each."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key, value in node.value:
            if key.value in seen:
                raise ConfigError(f"{path}:{key.start_mark.line + 1}: duplicate key {key.value!r} (first at line "
                                  f"{seen[key.value]}): rename or remove one")
            seen[key.value] = key.start_mark.line + 1
            check_unique_keys(value, path)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            check_unique_keys(item, path)


def _unique_pairs(path: Path):
    """json.loads' object_pairs_hook refusing a repeated key (JSON's parsers keep the last one silently)."""
    def hook(pairs: list) -> dict:
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ConfigError(f"{path}: duplicate key {key!r}: rename or remove one")
            seen.add(key)
        return dict(pairs)

    return hook


def read_mapping_file(path: str | Path, what: str, expected: str) -> dict:
    """A settings file the user gives (`what`: how the CLI names it, e.g. "--hardware-file x.yaml"): YAML for .yaml /
    .yml, else JSON; one line for a file that is missing, a folder, not UTF-8 text, empty, not valid, repeats a key,
    or holds something other than a mapping (`expected` says what it should hold)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what}: {'a folder' if path.is_dir() else 'no such file'}: give a file holding {expected}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what}: not a UTF-8 text file (byte {e.start}): give a file holding {expected}") from None
    if not text.strip():
        raise ConfigError(f"{what}: the file is empty: give {expected}")
    try:
        if path.suffix in (".yaml", ".yml"):
            node = yaml.compose(text, Loader=yaml.SafeLoader)
            check_unique_keys(node, path)
            data = yaml.safe_load(text)
        else:
            data = json.loads(text, object_pairs_hook=_unique_pairs(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{what}: not valid YAML{where} ({getattr(e, 'problem', None) or e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: holds a {type(data).__name__}, not a mapping: give {expected}")
    return data
