import os

import pytest
import torch

from llmopt.core.errors import ModelLoadError, ModelNotFoundError, UnsupportedArchitectureError
from llmopt.core.models import count_safetensors_parameters, describe_model, resolve_model
from llmopt.formats.load import load_model


def test_folder_loads_and_describes(tiny_llama_dir):
    model, tok, source = load_model(str(tiny_llama_dir))
    assert source.kind == "folder" and not model.training
    info = describe_model(source)
    assert info["family"] == "llama" and info["num_hidden_layers"] == 2
    assert info["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert count_safetensors_parameters(tiny_llama_dir) == info["num_parameters"]


def test_tiny_alias_is_built_once_into_the_cache(isolated_home):
    source = resolve_model("tiny-random-llama")
    assert source.kind == "alias" and source.path == isolated_home / "models" / "tiny-random-llama"
    first = (source.path / "model.safetensors").stat().st_mtime_ns
    again = resolve_model("tiny-random-llama")
    assert (again.path / "model.safetensors").stat().st_mtime_ns == first
    m1, _, _ = load_model("tiny-random-llama")
    from llmopt.core.tiny import build_tiny_model

    m2, _ = build_tiny_model("llama", seed=0)
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_unknown_and_missing_models(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model 'nope'.*smollm2-135m"):
        resolve_model("nope")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_pickle_weights_are_refused(tmp_path, tiny_llama_dir):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(ModelLoadError, match="pickle.*safetensors"):
        load_model(str(folder))


def test_corrupt_safetensors_is_a_clear_error(tmp_path, tiny_llama_dir):
    import shutil

    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)  # a header of 0 bytes: not JSON
    with pytest.raises(ModelLoadError, match="not a valid safetensors file"):
        load_model(str(folder))
    with pytest.raises(ModelLoadError, match="not a valid safetensors file"):
        describe_model(resolve_model(str(folder)))


def test_unsupported_family_is_refused(tmp_path):
    from transformers import AutoConfig

    folder = tmp_path / "gpt2"
    folder.mkdir()
    AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedArchitectureError, match="supported: deepseek_v2, deepseek_v3, llama"):
        load_model(str(folder))


def test_hub_id_offline_fails_clearly(monkeypatch, isolated_home):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(isolated_home / "hf"))
    with pytest.raises(ModelNotFoundError, match="no folder 'someorg/somemodel' here, and the Hugging Face hub is "
                       "unreachable"):
        load_model("someorg/somemodel")


def test_a_path_like_model_that_does_not_exist_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fx").mkdir()
    for name in ("fx/tiny-typo", "./tiny-typo", "../tiny-typo", str(tmp_path / "tiny-typo")):
        with pytest.raises(ModelNotFoundError, match="no such folder or file"):
            resolve_model(name)


def test_an_unreachable_hub_is_not_retried(monkeypatch, isolated_home):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")  # nothing listens there: refused at once
    monkeypatch.setenv("HF_HOME", str(isolated_home / "hf"))
    with pytest.raises(ModelNotFoundError, match="no folder 'someorg/somemodel' here, and the Hugging Face hub is "
                       "unreachable"):
        load_model("someorg/somemodel")
    # the lookups went offline (cache only) instead of retrying the hub
    assert constants.HF_HUB_OFFLINE is True and os.environ["HF_HUB_OFFLINE"] == "1"
