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
def smollm2():
    """SmolLM2-135M loaded once per session (fp32)."""
    from llmopt.export.load import load_model

    model, tokenizer, source = load_model("smollm2-135m")
    return model, tokenizer, source


@pytest.fixture
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"
