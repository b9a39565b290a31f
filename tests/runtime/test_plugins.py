"""A linear method, an attention backend and a Llama-like model family are each one module that registers itself:
all are defined here, in this test module alone, and run through the engine without another file knowing of
them."""

import pytest
import torch
import torch.nn.functional as F

from llmopt.compress.api import make_config, quantize_model
from llmopt.core.tiny import build_tiny_model
from llmopt.formats.artifact import write_model_artifact
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.attention import ATTENTION_BACKENDS, register_attention_backend
from llmopt.runtime.executor.attention.torch_sdpa import TorchAttention
from llmopt.runtime.executor.linear import LINEAR_METHODS, LinearMethod, register_linear_method
from llmopt.runtime.executor.loader import load_runtime_model
from llmopt.runtime.executor.models import MODEL_FAMILIES, register_model_family
from llmopt.runtime.executor.models.llama import LlamaFamilyDecoder

CALLS = {"linear": 0, "store": 0, "attend": 0, "family": 0}
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class ToyThreeBitLinear(LinearMethod):
    """3-bit weights kept as codes and scales, dequantized on every call: slow, simple, exact."""

    name, device_type = "toy-3bit", "cpu"
    overrides = ("int4-cpu",)  # (which also holds 3-bit codes)

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        self.register_buffer("codes", qweight.q.clone())
        self.register_buffer("scales", qweight.scales.clone())
        self.register_buffer("zeros", qweight.zeros.clone())
        self.register_buffer("g_idx", qweight.g_idx.long())

    @classmethod
    def accepts(cls, qweight, scheme, device):
        return scheme.weights.bits == 3

    @classmethod
    def create(cls, qweight, dtype, device):
        return cls(qweight, dtype, device)

    def _matmul(self, x2d):
        CALLS["linear"] += 1
        weight = self.scales[:, self.g_idx] * (self.codes.float() - self.zeros[:, self.g_idx].float())
        return F.linear(x2d, weight.to(x2d.dtype))


class CountingAttention(TorchAttention):
    name, priority = "toy-counting", -10  # never chosen by auto

    def store(self, k, v, cache, meta):
        CALLS["store"] += 1
        super().store(k, v, cache, meta)

    def attend(self, q, cache, meta, scale, k_new, v_new):
        CALLS["attend"] += 1
        return super().attend(q, cache, meta, scale, k_new, v_new)


@pytest.fixture
def registered():
    """The module's plug-ins registered for one test (they would otherwise take 3-bit weights everywhere)."""
    register_linear_method(ToyThreeBitLinear)
    register_attention_backend(CountingAttention)
    CALLS.update({key: 0 for key in CALLS})
    yield
    LINEAR_METHODS.remove(ToyThreeBitLinear.name)
    ATTENTION_BACKENDS.remove(CountingAttention.name)


@pytest.fixture(scope="module")
def three_bit_artifact(tmp_path_factory):
    model, tok = build_tiny_model("llama", seed=5)
    config = make_config("rtn", bits=3, group_size=32)
    result = quantize_model(model, tok, config)
    return write_model_artifact(tmp_path_factory.mktemp("toy") / "rtn3", model, tok, result.qweights, "gptq",
                                config.record(), {"stages": []}, dense_dtype=torch.float32)


def test_a_registered_linear_method_and_backend_run_through_the_engine(registered, three_bit_artifact):
    model, tok, _ = load_runtime_model(str(three_bit_artifact), dtype="float32")
    methods = {type(m).__name__ for m in model.modules()}
    assert "ToyThreeBitLinear" in methods
    engine = Engine(model, tok, EngineConfig(block_size=4, attention_backend="toy-counting", fast_path=False))
    assert engine.numerics()["attention_backend_resolved"] == "toy-counting"
    assert engine.numerics()["linear_methods"]["toy-3bit"] == 7 * 2
    ps = [tok.encode("hello there"), tok.encode("x = 1")]
    got = [o.token_ids for o in engine.generate(ps, GREEDY)]
    assert CALLS["linear"] > 0 and CALLS["store"] > 0 and CALLS["attend"] > 0
    # the toy computes what the dequantized weights do: the same tokens as transformers on them
    from llmopt.eval.hf_baseline import hf_generate
    from llmopt.formats.load import load_model

    dense, _, _ = load_model(str(three_bit_artifact), dtype="float32")
    assert got == [list(t) for t in hf_generate(dense, tok, ps, GREEDY)]


def test_an_unknown_backend_is_refused_naming_the_registered_ones(tiny_llama_dir):
    from llmopt.core.errors import ConfigError

    model, tok, _ = load_runtime_model(str(tiny_llama_dir), dtype="float32")
    with pytest.raises(ConfigError, match="unknown attention backend 'nope'.*cpu.*torch"):
        Engine(model, tok, EngineConfig(attention_backend="nope"))
    with pytest.raises(ConfigError, match="--attention-backend latent-torch cannot run here"):
        Engine(model, tok, EngineConfig(attention_backend="latent-torch"))


class ToyLlamaDecoder(LlamaFamilyDecoder):
    """A Llama-like family (here: Llama's layers, its forwards counted)."""

    def forward(self, *args, **kwargs):
        CALLS["family"] += 1
        return super().forward(*args, **kwargs)


@pytest.fixture
def toy_family():
    register_model_family("toy-llama")(ToyLlamaDecoder)
    CALLS.update({key: 0 for key in CALLS})
    yield
    MODEL_FAMILIES.remove("toy-llama")


def test_a_llama_like_family_is_one_class(toy_family):
    model, tok = build_tiny_model("llama", seed=3)
    ps = [tok.encode("hello there"), tok.encode("x = 1")]
    expected = [o.token_ids for o in Engine(model, tok, EngineConfig(block_size=4)).generate(ps, GREEDY)]
    model.config.model_type = "toy-llama"
    engine = Engine(model, tok, EngineConfig(block_size=4))
    assert type(engine.runner.decoder) is ToyLlamaDecoder
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == expected and CALLS["family"] > 0
