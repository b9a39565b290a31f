"""Writing outputs so that an interrupted run leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from llmopt.core.errors import ArtifactError


def check_output_free(output: str | Path, overwrite: bool = False) -> Path:
    """Fail early (before any expensive work) if `output` exists and may not be replaced."""
    output = Path(output).expanduser()
    if output.exists() and not overwrite:
        raise ArtifactError(f"output {output} already exists: choose another path or pass --overwrite")
    return output


@contextmanager
def atomic_output_dir(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `final`; rename it into place only if the block succeeds.

    >>> with atomic_output_dir("/tmp/out") as tmp:  # doctest: +SKIP
    ...     (tmp / "config.json").write_text("{}")
    """
    final = check_output_free(final, overwrite).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


@contextmanager
def atomic_output_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file name beside `path`; renamed over `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
