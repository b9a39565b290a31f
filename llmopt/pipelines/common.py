"""What every MODEL -> artifact pipeline shares: loading, the manifest's source entry, the facts' sizes."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def source_entry(model_name: str, source) -> dict:
    """llmopt.json's `source`: what MODEL was given and what it resolved to."""
    return {"model": model_name, "kind": source.kind, "path": str(source.path or source.hub_id)}


def weights_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
