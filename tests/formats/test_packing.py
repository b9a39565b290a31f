import pytest
import torch

from llmopt.formats.packing import deinterleave_awq, interleave_awq, pack_int32, unpack_int32


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(3, 32), (5, 96), (7, 40), (1, 13)])
@pytest.mark.parametrize("dim", [0, -1])
def test_round_trip_any_shape(bits, shape, dim):
    values = torch.randint(0, 2**bits, shape)
    packed = pack_int32(values, bits, dim=dim)
    assert packed.dtype == torch.int32
    n = shape[0] if dim == 0 else shape[1]
    import math
    assert packed.shape[dim] == math.ceil(n * bits / 32)
    assert torch.equal(unpack_int32(packed, bits, n, dim=dim), values)


def test_bit_layout_low_index_in_low_bits():
    # 4-bit: word = sum q[j] << 4j
    values = torch.arange(8).view(1, 8)
    assert pack_int32(values, 4).item() == 0x76543210
    # all 15s fill the word: the int32 bit pattern is -1
    assert pack_int32(torch.full((1, 8), 15), 4).item() == -1
    # 8-bit
    assert pack_int32(torch.tensor([[1, 2, 3, 4]]), 8).item() == 0x04030201
    # 2-bit
    assert pack_int32(torch.tensor([[3] + [0] * 15]), 2).item() == 3


def test_3bit_values_straddle_words_like_autogptq():
    values = torch.zeros(1, 32, dtype=torch.long)
    values[0, 10] = 0b111  # bits 30..32: two bits in word 0, one in word 1
    values[0, 21] = 0b101  # bits 63..65: one bit in word 1, two in word 2
    w = pack_int32(values, 3)[0].tolist()
    as_unsigned = [x & 0xFFFFFFFF for x in w]
    assert as_unsigned[0] == 0b11 << 30
    assert as_unsigned[1] == (1 | (1 << 31))
    assert as_unsigned[2] == 0b10


def test_awq_interleave_order():
    values = torch.arange(8).view(1, 8)  # column c holds value c
    word = interleave_awq(values).item() & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7]
    values = torch.randint(0, 16, (5, 24))
    assert torch.equal(deinterleave_awq(interleave_awq(values), 24), values)
