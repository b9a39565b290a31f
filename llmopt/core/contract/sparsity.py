"""How sparsity is recorded in a model's config: `sparsity_config` (`sparsity_entry`) gives the structure
("unstructured" or an N:M pattern along the input dimension), the method, the targets and the measured fraction of
zeros. Pruned linears are written compressed unless asked otherwise (2:4 and 4:8: sparse24.py; unstructured:
sparse_bitmask.py), and such a model also carries compressed-tensors' record of them, a `sparsity_config` inside
`quantization_config` (`compressed_sparsity`)."""

from __future__ import annotations

COMPRESSED_FORMAT = "sparse-24-bitmask"  # compressed-tensors' name for the half-sparse layout (sparse24.py)
UNSTRUCTURED_FORMAT = "sparse-bitmask"  # ... and for the unstructured one (sparse_bitmask.py)
COMPRESSED_FORMATS = (COMPRESSED_FORMAT, UNSTRUCTURED_FORMAT)


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
                   targets: list[str], storage: str = "dense") -> dict:
    """What config.json records about a sparse model (llmopt's `sparsity_config`); storage: "dense" or one of
    COMPRESSED_FORMATS."""
    return {"format": storage, "sparsity_structure": structure, "method": method,
            "targets": targets, "ignore": ["lm_head", "model.embed_tokens", *ignore],
            "target_sparsity": round(target, 6), "global_sparsity": round(measured, 6)}


def compressed_sparsity(qcfg) -> dict | None:
    """A quantization_config's sparsity_config when its linears are stored compressed (sparse-24-bitmask or
    sparse-bitmask), else None."""
    sparsity = _as_dict(qcfg).get("sparsity_config") or {}
    return sparsity if sparsity.get("format") in COMPRESSED_FORMATS else None


def compressed_format(structure: str) -> str:
    """The compressed layout of a model pruned to `structure`."""
    return UNSTRUCTURED_FORMAT if structure == "unstructured" else COMPRESSED_FORMAT


def quantizes(qcfg) -> bool:
    """Whether a config's quantization_config quantizes weights (compressed-tensors also uses the entry for
    compressed sparsity alone: no config groups then)."""
    qcfg = _as_dict(qcfg)
    if not qcfg:
        return False
    return qcfg.get("quant_method") != "compressed-tensors" or bool(qcfg.get("config_groups"))


def _as_dict(qcfg) -> dict:
    if qcfg is None:
        return {}
    return qcfg if isinstance(qcfg, dict) else qcfg.to_dict()


def held_dense(config) -> None:
    """Make a model config (transformers' object) of a checkpoint with compressed linears describe the same model
    held dense in memory, as the readers hold it: no compressed-sparsity quantization_config, the sparsity
    record's format "dense". Other configs are left as they are."""
    if compressed_sparsity(getattr(config, "quantization_config", None)) is not None:
        del config.quantization_config
    record = getattr(config, "sparsity_config", None)
    if record and record.get("format") in COMPRESSED_FORMATS:
        config.sparsity_config = {**record, "format": "dense"}
