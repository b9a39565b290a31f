"""Facts about the machine and installation, for `llmopt env` and for artifacts' provenance."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import torch

from llmopt import __version__
from llmopt.core.paths import data_dir, data_dir_candidates, llmopt_home

_PACKAGES = ("torch", "transformers", "safetensors", "accelerate", "datasets", "gguf", "compressed-tensors", "triton")


def package_versions() -> dict[str, str]:
    versions = {"llmopt": __version__, "python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def source_commit() -> str | None:
    """The git commit of the llmopt source this process runs (an editable checkout; "+dirty" with uncommitted
    changes), or None for an installed package or a machine without git."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def run_provenance() -> dict:
    """What a published result must say about where it ran: the CPU line, the device, the llmopt version and
    commit, torch's version, and when (UTC)."""
    from datetime import datetime, timezone

    from llmopt.core.hardware import cpu_line

    return {"cpu": cpu_line(), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "llmopt_version": __version__, "llmopt_commit": source_commit(), "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def environment_facts() -> dict:
    from llmopt.core.datasets import CORPORA
    from llmopt.core.models import ALIASES, alias_cache_dir

    root = data_dir()
    facts = {**package_versions()}
    facts.update({
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "llmopt_home": str(llmopt_home()),
        "data_dir": str(root) if root else f"none (looked in {', '.join(map(str, data_dir_candidates()))})",
        "datasets_in_data_dir": ", ".join(
            n for n in CORPORA.names()
            if CORPORA.get(n).data_file and root and (root / CORPORA.get(n).data_file).is_file()
        ) or "none",
        "model_aliases_cached": ", ".join(
            n for n in ALIASES.names() if (alias_cache_dir(n) / "config.json").exists()
        ) or "none",
        "executable": sys.executable,
    })
    return facts
