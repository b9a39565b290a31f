import pytest
import torch

from llmopt.core.medusa import MedusaHeads
from llmopt.core.tiny import build_tiny_model, save_tiny_model
from llmopt.runtime.engine.config import SpeculativeConfig


@pytest.fixture(scope="session")
def tiny():
    return build_tiny_model("llama", seed=0)


@pytest.fixture(scope="session")
def spec_files(tmp_path_factory):
    """A draft identical to the target (every draft accepted), a different draft (most rejected), and Medusa
    heads with random weights (some accepted)."""
    root = tmp_path_factory.mktemp("spec")
    save_tiny_model(root / "same", "llama", seed=0)
    save_tiny_model(root / "other", "llama", seed=1)
    model, _ = build_tiny_model("llama", seed=0)
    heads = MedusaHeads(3, model.config.hidden_size)
    g = torch.Generator().manual_seed(0)
    for head in heads.heads:
        head.weight.data = torch.randn(head.weight.shape, generator=g) * 0.05
    heads.save(root / "medusa_heads.safetensors")
    return root


PROPOSERS = ["ngram", "draft-same", "draft-other", "medusa"]


def speculative(name: str, files, k: int = 4, adaptive: bool = False) -> SpeculativeConfig:
    if name == "ngram":
        return SpeculativeConfig("ngram", num_speculative_tokens=k, adaptive=adaptive)
    if name.startswith("draft"):
        return SpeculativeConfig("draft", str(files / name.split("-")[1]), num_speculative_tokens=k, adaptive=adaptive)
    return SpeculativeConfig("medusa", str(files), num_speculative_tokens=k, adaptive=adaptive)
