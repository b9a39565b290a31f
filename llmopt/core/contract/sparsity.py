"""How sparsity is recorded in a model's config: `sparsity_config` (`sparsity_entry`) gives the structure
("unstructured" or an N:M pattern along the input dimension), the method, the targets and the measured fraction of
zeros; the weights themselves stay dense with zeros in place."""

from __future__ import annotations


def parse_nm(pattern: str) -> tuple[int, int]:
    """'2:4' -> (2, 4); ValueError (for the config validators) unless 0 < N < M."""
    try:
        n, m = (int(v) for v in pattern.split(":"))
    except ValueError:
        raise ValueError(f"pattern {pattern!r} is not N:M (e.g. 2:4)") from None
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern}: need 0 < N < M")
    return n, m


def sparsity_entry(structure: str, method: str, target: float, ignore: list[str], measured: float,
                   targets: list[str]) -> dict:
    """What config.json records about a sparse model (llmopt's `sparsity_config`)."""
    return {"format": "dense", "sparsity_structure": structure, "method": method,
            "targets": targets, "ignore": ["lm_head", "model.embed_tokens", *ignore],
            "target_sparsity": round(target, 6), "global_sparsity": round(measured, 6)}
