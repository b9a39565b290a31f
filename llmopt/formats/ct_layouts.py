"""compressed-tensors' tensor layouts, one registered class each (a quantized linear's tensors under its module
name, as compressed-tensors' compressors write and read them): which weights and inputs a layout holds
(`holds`, when writing), which stored tensors it reads (`reads`), and its `pack` / `unpack` of the contract's
QuantizedWeight. A weight grid of a plug-in brings its own layout by registering one here (`register_ct_layout`);
CompressedTensorsFormat (formats.layouts) asks the registry, never a scheme's type. W is [N out, K in]; G = number
of groups; the layouts' tensors are described in CompressedTensorsFormat's docstring and docs/formats.md."""

from __future__ import annotations

from typing import ClassVar

import torch

from llmopt.core.contract import QuantizedWeight, QuantScheme, default_g_idx
from llmopt.core.contract.fp4 import e8m0_decode, pack_nibbles, scale_bytes, unpack_nibbles
from llmopt.core.contract.sparse24 import unpack_mask
from llmopt.core.errors import ArtifactError
from llmopt.core.registry import Registry
from llmopt.formats.packing import SCALE_DTYPE, pack_int32, stored_bias, unpack_int32


class CTLayout:
    """One compressed-tensors format (the config's `format`): its name, the tensor suffix that marks a linear
    stored in it, and its packing."""

    name: ClassVar[str]
    marker: ClassVar[str] = "weight_scale"  # (the packed layouts': weight_packed)

    def holds(self, weights: QuantScheme, acts: QuantScheme | None) -> bool:
        """Whether weights quantized with `weights`, their inputs with `acts` (None: not quantized), are written
        in this layout."""
        raise NotImplementedError

    def reads(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> bool:
        """Whether a linear's stored `tensors`, of weights quantized with `scheme`, are in this layout."""
        raise NotImplementedError

    def pack(self, qweight: QuantizedWeight) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def unpack(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantizedWeight:
        raise NotImplementedError


CT_LAYOUTS: Registry[CTLayout] = Registry("compressed-tensors format")


def register_ct_layout(cls: type) -> type:
    """Class decorator: add a layout (an instance of `cls`) to the registry under its `name`."""
    CT_LAYOUTS.register(cls.name)(cls())
    return cls


def layout_for(weights: QuantScheme, acts: QuantScheme | None) -> CTLayout:
    """The layout that holds these weights and inputs (the first by name, were several to)."""
    for name in CT_LAYOUTS:
        if CT_LAYOUTS.get(name).holds(weights, acts):
            return CT_LAYOUTS.get(name)
    raise ArtifactError(f"compressed-tensors has no format for {weights.bits}-bit {weights.type} weights"
                        + ("" if acts is None else f" with {acts.bits}-bit {acts.type} inputs")
                        + f" (it holds: {', '.join(CT_LAYOUTS.names())})")


def layout_of(tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> CTLayout:
    """The layout these stored tensors of a `scheme` weight are in."""
    for name in CT_LAYOUTS:
        if CT_LAYOUTS.get(name).reads(tensors, scheme):
            return CT_LAYOUTS.get(name)
    raise ArtifactError(f"no compressed-tensors format reads {scheme.bits}-bit {scheme.type} weights stored as "
                        f"{', '.join(sorted(tensors))}")


def g_idx_and_bias(qweight: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The tensors every layout adds when present: permuted groups' g_idx, the bias."""
    out = {}
    if not qweight.has_trivial_g_idx:
        out["weight_g_idx"] = qweight.g_idx.to(torch.int32)
    if qweight.bias is not None:
        out["bias"] = qweight.bias.to(SCALE_DTYPE)
    return out


def _integer(scheme: QuantScheme) -> bool:
    return scheme.type == "int" and not scheme.float_zero_point


@register_ct_layout
class PackQuantized(CTLayout):
    """Integer codes packed eight (4-bit) to an int32 along K, weight-only; a 2:4 weight stored compressed packs
    only its kept codes and adds its bitmask."""

    name, marker = "pack-quantized", "weight_packed"

    def holds(self, weights, acts):
        return _integer(weights) and acts is None

    def reads(self, tensors, scheme):
        return _integer(scheme) and "weight_packed" in tensors

    def pack(self, qweight):
        n, k = qweight.shape
        b = qweight.scheme.bits
        # Our unsigned codes already equal signed q + 2^(b-1), the stored value; zp_signed + 2^(b-1) = z.
        codes, sparse = qweight.q, {}
        if qweight.keep is not None:  # 2:4 stored compressed: the kept codes only, and where they go
            codes = qweight.q[unpack_mask(qweight.keep, k)].reshape(n, k // 2)
            sparse = {"bitmask": qweight.keep.contiguous()}
        out = {
            "weight_packed": pack_int32(codes, b, dim=-1),
            "weight_scale": qweight.scales.to(SCALE_DTYPE).contiguous(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
        if not qweight.scheme.sym:
            out["weight_zero_point"] = pack_int32(qweight.zeros, b, dim=0)
        return {**out, **sparse, **g_idx_and_bias(qweight)}

    def unpack(self, tensors, scheme):
        n, k = (int(v) for v in tensors["weight_shape"])
        b = scheme.bits
        scales = tensors["weight_scale"].float()
        if "weight_zero_point" in tensors:
            zeros = unpack_int32(tensors["weight_zero_point"], b, n, dim=0)
        else:
            zeros = torch.full_like(scales, 2 ** (b - 1), dtype=torch.int64)
        g_idx = tensors.get("weight_g_idx")
        g_idx = default_g_idx(k, scheme) if g_idx is None else g_idx.to(torch.int32)
        keep = tensors.get("bitmask")
        if keep is None:
            q = unpack_int32(tensors["weight_packed"], b, k, dim=-1)
        else:  # 2:4 stored compressed: the kept codes into their columns, the zero point (weight 0) elsewhere
            q = zeros[:, g_idx.long()].clone()
            q[unpack_mask(keep, k)] = unpack_int32(tensors["weight_packed"], b, k // 2, dim=-1).reshape(-1).to(q.dtype)
        return QuantizedWeight(q.to(torch.uint8), scales, zeros.to(torch.int32), g_idx, scheme, stored_bias(tensors),
                               keep=keep)


@register_ct_layout
class IntQuantized(CTLayout):
    """8-bit integer codes one per int8 (W8A8: the inputs quantized at run time)."""

    name = "int-quantized"

    def holds(self, weights, acts):
        return _integer(weights) and acts is not None

    def reads(self, tensors, scheme):
        return _integer(scheme) and "weight_packed" not in tensors

    def pack(self, qweight):
        offset = 2 ** (qweight.scheme.bits - 1)
        out = {"weight": qweight.signed_codes().contiguous(),
               "weight_scale": qweight.scales.to(SCALE_DTYPE).contiguous()}
        if qweight.scheme.float_zero_point:  # signed like the codes: z - 2^(b-1), float32 (zp_dtype)
            out["weight_zero_point"] = (qweight.zeros.float() - offset).contiguous()
        elif not qweight.scheme.sym:
            out["weight_zero_point"] = (qweight.zeros - offset).to(torch.int8).contiguous()
        return {**out, **g_idx_and_bias(qweight)}

    def unpack(self, tensors, scheme):
        offset = 2 ** (scheme.bits - 1)
        weight = tensors["weight"]
        if weight.dtype != torch.int8:
            raise ArtifactError(f"int-quantized weight of dtype {weight.dtype}: expected int8 codes")
        q = (weight.to(torch.int16) + offset).to(torch.uint8)
        scales = tensors["weight_scale"].float().reshape(q.shape[0], -1)
        zp = tensors.get("weight_zero_point")
        if scheme.float_zero_point:
            if zp is None or not zp.is_floating_point():
                raise ArtifactError("a float zero point scheme (zp_dtype float) without a float weight_zero_point")
            zeros = zp.float().reshape(scales.shape) + offset
        else:
            zeros = (torch.full(scales.shape, offset, dtype=torch.int32) if zp is None
                     else (zp.to(torch.int32).reshape(scales.shape) + offset))
        g_idx = tensors.get("weight_g_idx")
        g_idx = default_g_idx(q.shape[1], scheme) if g_idx is None else g_idx.to(torch.int32)
        return QuantizedWeight(q, scales, zeros, g_idx, scheme, stored_bias(tensors))


@register_ct_layout
class NaiveQuantized(IntQuantized):
    """int-quantized's tensors with a float zero point (real-valued, float32), weight-only."""

    name = "naive-quantized"

    def holds(self, weights, acts):
        return weights.type == "int" and weights.float_zero_point

    def reads(self, tensors, scheme):
        return scheme.type == "int" and scheme.float_zero_point


@register_ct_layout
class FloatQuantized(CTLayout):
    """FP8 (E4M3) values one per byte."""

    name = "float-quantized"

    def holds(self, weights, acts):
        return weights.type == "float" and weights.scale_format is None

    def reads(self, tensors, scheme):
        return self.holds(scheme, None)

    def pack(self, qweight):
        out = {"weight": qweight.q.view(torch.float8_e4m3fn).contiguous(),
               "weight_scale": qweight.scales.to(SCALE_DTYPE).contiguous()}
        return {**out, **g_idx_and_bias(qweight)}

    def unpack(self, tensors, scheme):
        weight = tensors["weight"]
        if weight.dtype != torch.float8_e4m3fn:
            raise ArtifactError(f"float-quantized weight of dtype {weight.dtype}: expected float8_e4m3fn")
        q = weight.contiguous().view(torch.uint8)
        scales = tensors["weight_scale"].float().reshape(q.shape[0], -1)
        return QuantizedWeight(q, scales, torch.zeros(scales.shape, dtype=torch.int32),
                               default_g_idx(q.shape[1], scheme), scheme, stored_bias(tensors))


class FP4PackQuantized(CTLayout):
    """E2M1 codes two per byte under block scales: NVFP4's (E4M3 scales, a global scale) or MXFP4's (E8M0)."""

    marker = "weight_packed"
    scale_format: ClassVar[str]

    def holds(self, weights, acts):
        return weights.type == "float" and weights.scale_format == self.scale_format

    def reads(self, tensors, scheme):
        return self.holds(scheme, None)

    def pack(self, qweight):
        scale_format = qweight.scheme.scale_format
        out = {"weight_packed": pack_nibbles(qweight.q), "weight_scale": scale_bytes(qweight.scales, scale_format)}
        if scale_format == "e4m3":
            out["weight_scale"] = out["weight_scale"].view(torch.float8_e4m3fn)
            out["weight_global_scale"] = qweight.global_scale.float().reshape(1).clone()  # (shared by q/k/v)
        if qweight.input_global_scale is not None:  # NVFP4 inputs' calibrated global scale
            out["input_global_scale"] = qweight.input_global_scale.float().reshape(1).clone()
        return {**out, **g_idx_and_bias(qweight)}

    def unpack(self, tensors, scheme):
        packed, stored = tensors["weight_packed"], tensors["weight_scale"]
        if packed.dtype != torch.uint8:
            raise ArtifactError(f"{scheme.fp4_name} weight_packed of dtype {packed.dtype}: expected uint8")
        q = unpack_nibbles(packed)
        if scheme.scale_format == "e4m3":
            scales, global_scale = stored.float(), tensors["weight_global_scale"].float().reshape(1)
        else:
            scales, global_scale = e8m0_decode(stored.view(torch.uint8)), None
        scales = scales.reshape(q.shape[0], -1).contiguous()
        inputs = tensors.get("input_global_scale")
        return QuantizedWeight(q, scales, torch.zeros_like(scales, dtype=torch.int32),
                               default_g_idx(q.shape[1], scheme), scheme, stored_bias(tensors), global_scale=global_scale,
                               input_global_scale=None if inputs is None else inputs.float().reshape(1))


@register_ct_layout
class NVFP4PackQuantized(FP4PackQuantized):
    name, scale_format = "nvfp4-pack-quantized", "e4m3"


@register_ct_layout
class MXFP4PackQuantized(FP4PackQuantized):
    name, scale_format = "mxfp4-pack-quantized", "e8m0"
