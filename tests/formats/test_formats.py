import pytest
import torch

from llmopt.core.contract import QuantizedWeight, QuantScheme
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.core.errors import ArtifactError
from llmopt.formats.layouts import FORMATS


def make_qweight(bits=4, group_size=32, sym=True, n=64, k=128, bias=False, permute=False):
    torch.manual_seed(0)
    qw = quantize_rtn(torch.randn(n, k), QuantScheme(bits, group_size, sym), bias=torch.randn(n) if bias else None)
    if permute:
        qw.g_idx = qw.g_idx[torch.randperm(k)]
    qw.scales = qw.scales.half().float()  # what a checkpoint can hold
    return qw


def assert_same(a: QuantizedWeight, b: QuantizedWeight):
    assert torch.equal(a.q, b.q) and torch.equal(a.zeros, b.zeros) and torch.equal(a.g_idx, b.g_idx)
    torch.testing.assert_close(a.scales, b.scales)
    torch.testing.assert_close(a.dequantize(), b.dequantize())


CASES = [
    ("gptq", dict(bits=b, sym=s)) for b in (2, 3, 4, 8) for s in (True, False)
] + [("gptq", dict(group_size=-1)), ("gptq", dict(permute=True)), ("gptq", dict(bias=True)),
     ("awq", dict(sym=True)), ("awq", dict(sym=False)), ("awq", dict(bias=True)), ("awq", dict(n=40))] + [
    ("compressed-tensors", dict(bits=b, sym=s)) for b in (2, 3, 4, 8) for s in (True, False)
] + [("compressed-tensors", dict(n=37, k=96, group_size=32)), ("compressed-tensors", dict(permute=True)),
     ("compressed-tensors", dict(group_size=-1, sym=False))]


@pytest.mark.parametrize("fmt_name,kwargs", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_pack_unpack_round_trip(fmt_name, kwargs):
    fmt = FORMATS.get(fmt_name)
    qw = make_qweight(**kwargs)
    fmt.check("x", qw.shape, qw.scheme, qw.has_trivial_g_idx)
    back = fmt.unpack(fmt.pack(qw), qw.scheme)
    assert_same(qw, back)


def test_gptq_v1_stores_zero_minus_one():
    qw = make_qweight(bits=4, sym=True, n=8, k=32)
    packed = FORMATS.get("gptq").pack(qw)
    assert packed["qzeros"].shape == (1, 1)  # [G, N*4/32]
    assert packed["qzeros"].item() == 0x77777777  # z = 8 stored as 7 in every nibble
    assert packed["qweight"].shape == (4, 8)  # [K*4/32, N]
    # word [r, n] holds q[8r + j, n] << 4j (q transposed: rows are input features)
    word = packed["qweight"][0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == qw.q[0, :8].tolist()


def test_compressed_tensors_layout():
    qw = make_qweight(bits=4, sym=False, n=8, k=32)
    packed = FORMATS.get("compressed-tensors").pack(qw)
    assert packed["weight_packed"].shape == (8, 4)  # [N, K*4/32], along K
    assert packed["weight_zero_point"].shape == (1, 1)  # [N*4/32, G], along N
    assert packed["weight_shape"].tolist() == [8, 32]
    word = packed["weight_packed"][0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == qw.q[0, :8].tolist()


def test_format_limits_are_explained():
    with pytest.raises(ArtifactError, match="4-bit only"):
        FORMATS.get("awq").check("l", (64, 128), QuantScheme(3, 32), True)
    with pytest.raises(ArtifactError, match="act-order.*no g_idx"):
        FORMATS.get("awq").check("l", (64, 128), QuantScheme(4, 32), False)
    with pytest.raises(ArtifactError, match="whole int32 words.*compressed-tensors"):
        FORMATS.get("gptq").check("l", (64, 100), QuantScheme(3, -1), True)
