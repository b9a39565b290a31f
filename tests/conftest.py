import os

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from llmopt.core.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from llmopt.core.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_gptq_artifact(tmp_path_factory):
    """The tiny Llama quantized by GPTQ (4 bits, groups of 32) and written in the GPTQ format (fp32 dense parts)."""
    import torch

    from llmopt.compress.api import make_config, quantize_model
    from llmopt.core.tiny import build_tiny_model
    from llmopt.formats.artifact import write_model_artifact

    model, tok = build_tiny_model("llama", seed=0)
    config = make_config("gptq", bits=4, group_size=32, calib="pystdlib", num_samples=4, seqlen=32)
    result = quantize_model(model, tok, config)
    return write_model_artifact(tmp_path_factory.mktemp("art") / "gptq", model, tok, result.qweights, "gptq",
                                config.record(), {"stages": []}, dense_dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M loaded once per session (fp32)."""
    from llmopt.formats.load import load_model

    model, tokenizer, source = load_model("smollm2-135m")
    return model, tokenizer, source


@pytest.fixture
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"
