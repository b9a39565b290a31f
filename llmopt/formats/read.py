"""Reading an llmopt (or any GPTQ / AWQ / compressed-tensors) checkpoint folder back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from llmopt.core.contract import QuantizedWeight, QuantScheme
from llmopt.core.contract.activations import InputQuantizedLinear
from llmopt.core.contract.sparse24 import Sparse24Weight
from llmopt.core.contract.sparse_bitmask import BitmaskWeight
from llmopt.core.contract.sparsity import UNSTRUCTURED_FORMAT, compressed_sparsity, held_dense, quantizes
from llmopt.core.errors import ArtifactError, ModelLoadError
from llmopt.core.io import read_json
from llmopt.core.models import rebuild_meta_buffers
from llmopt.formats.layouts import Format, format_for_config


@dataclass
class ArtifactContents:
    config: dict
    dense: dict[str, torch.Tensor]  # every tensor that is not part of a quantized linear
    qweights: dict[str, QuantizedWeight]  # module path -> quantized weight
    fmt: Format | None
    scheme: QuantScheme | None
    manifest: dict
    sparse: dict = field(default_factory=dict)  # module path -> compressed sparse weight (Sparse24 / Bitmask)

    def linears(self) -> dict:
        """Every linear stored in a form of its own (quantized or compressed), by module path."""
        return {**self.qweights, **self.sparse}


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ArtifactError(f"{path} has no *.safetensors weights")
    tensors = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"cannot read {file}: {str(e).splitlines()[0]}: re-create the artifact") from e
    return tensors


def read_artifact(path: str | Path) -> ArtifactContents:
    path = Path(path)
    config = read_json(path / "config.json")
    manifest = read_json(path / "llmopt.json") if (path / "llmopt.json").exists() else {}
    tensors = _load_tensors(path)
    qcfg = config.get("quantization_config")
    if not quantizes(qcfg):
        sparse = _take_sparse(path, tensors, compressed_sparsity(qcfg))
        return ArtifactContents(config, tensors, {}, None, None, manifest, sparse)
    # (quantized 2:4 linears stored compressed keep their bitmask among their own tensors: formats.layouts)
    fmt = format_for_config(qcfg)
    scheme = fmt.scheme_from_config(qcfg)
    input_activations = fmt.input_activations_from_config(qcfg)
    marker = "." + fmt.marker_for(qcfg)
    prefixes = sorted(k[: -len(marker)] for k in tensors if k.endswith(marker))
    qweights = {}
    for prefix in prefixes:
        own = {k[len(prefix) + 1:]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix + ".")}
        try:
            qweights[prefix] = fmt.unpack(own, scheme)
        except KeyError as e:
            raise ArtifactError(f"{path}: {prefix} lacks tensor {e}: the checkpoint is incomplete") from None
        qweights[prefix].input_activations = input_activations
    return ArtifactContents(config, tensors, qweights, fmt, scheme, manifest)


def _take_sparse(path: Path, tensors: dict[str, torch.Tensor], sparsity: dict | None) -> dict:
    """The compressed linears (marked by `.bitmask`: Sparse24Weight or BitmaskWeight, as the sparsity_config's
    format says), their tensors taken out of `tensors`."""
    if sparsity is None:
        return {}
    pattern = sparsity.get("sparsity_structure") or "2:4"
    unstructured = sparsity["format"] == UNSTRUCTURED_FORMAT
    marker = ".bitmask"
    sparse = {}
    for prefix in sorted(k[: -len(marker)] for k in tensors if k.endswith(marker)):
        own = {k[len(prefix) + 1:]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix + ".")}
        try:
            sparse[prefix] = (BitmaskWeight.from_tensors(own) if unstructured
                              else Sparse24Weight.from_tensors(own, pattern))
        except KeyError as e:
            raise ArtifactError(f"{path}: {prefix} lacks tensor {e}: the checkpoint is incomplete") from None
    return sparse


def model_from_contents(contents: ArtifactContents, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        linear_factory: Callable[[QuantizedWeight], torch.nn.Module] | None = None):
    """A transformers model with every quantized linear dequantized into a dense weight, or, given
    `linear_factory`, replaced by the module it builds from the quantized weight (the runtime's packed layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmopt.core.adapters import set_module

    config_dict = {k: v for k, v in contents.config.items() if k not in ("quantization_config",)}
    config = AutoConfig.for_model(**config_dict)
    held_dense(config)  # (compressed linears are held dense in memory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    expected = set(model.state_dict())
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in contents.dense.items()}
    for name, qweight in contents.linears().items():
        if linear_factory is None and qweight.input_activations is not None:
            set_module(model, name, InputQuantizedLinear.of(qweight, dtype))  # W8A8: inputs fake-quantized
            expected -= {f"{name}.weight", f"{name}.bias"}
            continue
        if linear_factory is not None:
            set_module(model, name, linear_factory(qweight))
            expected -= {f"{name}.weight", f"{name}.bias"}
            continue
        state[f"{name}.weight"] = qweight.dequantize(dtype)
        if qweight.bias is not None:
            state[f"{name}.bias"] = qweight.bias.to(dtype)
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    missing = expected - set(state)
    if missing:
        raise ArtifactError(f"checkpoint lacks {len(missing)} tensors (e.g. {sorted(missing)[0]}): it is incomplete")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    rebuild_meta_buffers(model)
    return model.to(device).eval()


def load_artifact_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        linear_factory: Callable[[QuantizedWeight], torch.nn.Module] | None = None):
    return model_from_contents(read_artifact(path), dtype, device, linear_factory)
