"""Where llmopt keeps its cache and finds its data."""

from __future__ import annotations

import os
from pathlib import Path

# The repository checkout this package lives in (when installed editable); ../shared/data sits beside it.
_REPO_ROOT = Path(__file__).resolve().parents[2]


def llmopt_home() -> Path:
    """Cache root: $LLMOPT_HOME, default ~/.cache/llmopt."""
    return Path(os.environ.get("LLMOPT_HOME") or Path.home() / ".cache" / "llmopt").expanduser()


def data_dir_candidates() -> list[Path]:
    """Folders laid out like shared/data, in the order they are searched."""
    candidates = []
    if os.environ.get("LLMOPT_DATA_DIR"):
        candidates.append(Path(os.environ["LLMOPT_DATA_DIR"]).expanduser())
    candidates.append(_REPO_ROOT.parent / "shared" / "data")
    return candidates


def data_dir() -> Path | None:
    """The first existing data folder, or None (then datasets come from the hub)."""
    for path in data_dir_candidates():
        if path.is_dir():
            return path
    return None
