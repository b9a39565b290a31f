"""Configs are checked before any allocation: absurd or inconsistent sizes name the field (they were torch's
"Storage size calculation overflowed"), weights beyond memory say how much they need, `models info` marks such a
config unsupported with the reason."""

import json
import shutil
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

from llmopt.core.config_checks import config_problem, memory_problem, size_problem
from tests.cli.test_cli import assert_one_line_error, run

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000)


@pytest.mark.parametrize("change, field, message", [
    ({"vocab_size": 0}, "vocab_size", "vocab_size is 0: it must be a positive integer"),
    ({"num_hidden_layers": -3}, "num_hidden_layers", "num_hidden_layers is -3"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "num_attention_heads (4) is not a multiple of "
                                                         "num_key_value_heads (3)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2}, "num_attention_heads",
     "hidden_size (64) is not a multiple of num_attention_heads (6)"),
])
def test_inconsistent_sizes_name_the_field(change, field, message):
    # a plain namespace: transformers' own config classes refuse some of these themselves
    problem = size_problem(SimpleNamespace(**{**BASE, **change}))
    assert problem is not None and problem[0] == field and message in problem[1]


def test_weights_beyond_memory_name_the_largest_part():
    huge = LlamaConfig(**{**BASE, "vocab_size": 10 ** 12})
    problem = memory_problem(huge, 4, 24 * 2 ** 30)
    assert "vocab_size x hidden_size" in problem and "GiB" in problem and "24.0 GiB" in problem
    assert memory_problem(LlamaConfig(**BASE), 4, 24 * 2 ** 30) is None
    assert config_problem(LlamaConfig(**BASE), 4) is None


def absurd_model(tiny_llama_dir, tmp_path, **changes):
    folder = tmp_path / "absurd"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize("changes, pattern", [
    ({"vocab_size": 10 ** 12}, r"weights need about .* GiB .*vocab_size x hidden_size"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
])
def test_absurd_configs_are_one_line_before_loading(tiny_llama_dir, tmp_path, changes, pattern):
    folder = absurd_model(tiny_llama_dir, tmp_path, **changes)
    for args in (["generate", folder, "-p", "x", "--max-tokens", "2", "--dtype", "float32"],
                 ["eval", "ppl", folder, "--dataset", "pystdlib", "--seqlen", "32", "--max-tokens", "64", "--dtype", "float32"],
                 ["quantize", folder, "--method", "rtn", "-o", tmp_path / "q"]):
        assert_one_line_error(run(*args), pattern)
    assert not (tmp_path / "q").exists()
    result = run("models", "info", folder, "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    assert facts["supported"] is False and facts["unsupported_reason"]
    healthy = json.loads(run("models", "info", tiny_llama_dir, "--json").output)
    assert healthy["supported"] is True and healthy["unsupported_reason"] is None


def test_a_config_that_does_not_match_its_weights_is_one_line(tiny_llama_dir, tmp_path):
    """intermediate_size edited to 256 over 128-wide weights: the runtime generated garbage from it and
    transformers failed with "look at the above report" (never shown); both now name the tensor and the shapes."""
    folder = absurd_model(tiny_llama_dir, tmp_path, intermediate_size=256)
    pattern = r"down_proj.weight is \[64, 128\] but the config of .* makes it \[64, 256\]"
    assert_one_line_error(run("generate", folder, "-p", "x", "--max-tokens", "2", "--dtype", "float32"), pattern)
    assert_one_line_error(run("eval", "ppl", folder, "--dataset", "pystdlib", "--seqlen", "32", "--max-tokens", "64",
                              "--dtype", "float32"), pattern)
