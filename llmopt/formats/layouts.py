"""Checkpoint formats: each knows what it can hold, how to pack a QuantizedWeight, and how to read it back.

Layouts (AutoGPTQ v1, AutoAWQ GEMM, compressed-tensors pack-quantized) are described in docs/formats.md.
W is [N out, K in]; G = number of groups.
"""

from __future__ import annotations


import torch

from llmopt.core.contract import QuantizedWeight, QuantRecord, QuantScheme, default_g_idx
from llmopt.core.errors import ArtifactError
from llmopt.core.registry import Registry
from llmopt.formats.ct_layouts import CT_LAYOUTS, layout_for, layout_of
from llmopt.formats.packing import (
    SCALE_DTYPE, deinterleave_awq, interleave_awq, pack_int32, stored_bias, unpack_int32,
)


class Format:
    name: str
    marker: str  # the tensor suffix that marks a quantized linear in this format

    def check(self, name: str, shape: tuple[int, int], scheme: QuantScheme, trivial_g_idx: bool = True) -> None:
        """Raise ArtifactError saying why this format cannot hold a [N, K] linear quantized with `scheme`
        (trivial_g_idx False: act-order permuted groups). Called before quantizing and again before writing."""

    def pack(self, qweight: QuantizedWeight) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def unpack(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantizedWeight:
        raise NotImplementedError

    def check_record(self, record: QuantRecord) -> None:
        """Raise ArtifactError if this format cannot record what `record` asks for beyond the weights (quantized
        input activations: only compressed-tensors states them)."""
        if record.input_activations is not None:
            raise ArtifactError(f"format {self.name} cannot record quantized input activations (W8A8, FP8 or NVFP4 "
                                f"inputs): use --format compressed-tensors")

    def quantization_config(self, record: QuantRecord) -> dict:
        """The config.json `quantization_config` entry for weights quantized as `record` says."""
        raise NotImplementedError

    def scheme_from_config(self, qcfg: dict) -> QuantScheme:
        raise NotImplementedError

    def input_activations_from_config(self, qcfg: dict) -> QuantScheme | None:
        """The scheme the checkpoint quantizes its linears' inputs with at run time (None: weight-only)."""
        return None

    def marker_for(self, qcfg: dict) -> str:
        """The tensor suffix that marks a quantized linear in a checkpoint with this quantization_config."""
        return self.marker


FORMATS: Registry[Format] = Registry("format")


def _fail(fmt: str, name: str, why: str, hint: str) -> ArtifactError:
    return ArtifactError(f"format {fmt} cannot hold {name}: {why}; {hint}")


class GPTQFormat(Format):
    """AutoGPTQ v1: qweight [K*b/32, N] packed along K; qzeros [G, N*b/32] storing z - 1; scales [G, N]."""

    name, marker = "gptq", "qweight"

    def check(self, name, shape, scheme, trivial_g_idx=True):
        n, k = shape
        b = scheme.bits
        if scheme.type != "int":
            raise _fail(self.name, name, f"{scheme.type} weights (GPTQ stores integer codes)", "use compressed-tensors")
        if scheme.float_zero_point:
            raise _fail(self.name, name, "float zero points (GPTQ's qzeros are packed integer codes)",
                        "use compressed-tensors")
        if (k * b) % 32 or (n * b) % 32:
            raise _fail(self.name, name, f"{b}-bit rows of {k} x {n} do not fill whole int32 words",
                        "use compressed-tensors")

    def pack(self, qweight):
        b = qweight.scheme.bits
        out = {
            "qweight": pack_int32(qweight.q.t(), b, dim=0),  # [K*b/32, N]
            "qzeros": pack_int32((qweight.zeros - 1).t(), b, dim=-1),  # [G, N*b/32]
            "scales": qweight.scales.t().contiguous().to(SCALE_DTYPE),  # [G, N]
            "g_idx": qweight.g_idx.to(torch.int32),
        }
        if qweight.bias is not None:
            out["bias"] = qweight.bias.to(SCALE_DTYPE)
        return out

    def unpack(self, tensors, scheme):
        b = scheme.bits
        scales = tensors["scales"].float().t().contiguous()  # [N, G]
        n = scales.shape[0]
        k = tensors["g_idx"].numel()
        q = unpack_int32(tensors["qweight"], b, k, dim=0).t()
        zeros = unpack_int32(tensors["qzeros"], b, n, dim=-1).t() + 1
        return QuantizedWeight(q.to(torch.uint8).contiguous(), scales, zeros.to(torch.int32).contiguous(),
                               tensors["g_idx"].to(torch.int32), scheme, stored_bias(tensors))

    def quantization_config(self, record):
        scheme = record.scheme
        config = {
            "quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size,
            # desc_act tells loaders the columns' groups are permuted (g_idx not k // group_size). Act-order with
            # static groups quantizes in the permuted order but keeps every column's group k // group_size and
            # stores the columns in their own order, so its g_idx is trivial and the checkpoint is the plain
            # layout: desc_act false, as GPTQModel writes it (loaders that refuse act-order, vLLM's among them,
            # take it); how it was quantized stays in llmopt.json and in static_groups.
            "desc_act": record.act_order and not record.static_groups, "sym": scheme.sym,
            "true_sequential": record.true_sequential,
            "static_groups": record.static_groups, "checkpoint_format": "gptq", "lm_head": False,
        }
        if record.damp is not None:  # (methods without a Hessian have none to record)
            config["damp_percent"] = record.damp
        return config

    def scheme_from_config(self, qcfg):
        if qcfg.get("checkpoint_format", "gptq") != "gptq":
            raise ArtifactError(f"GPTQ checkpoint_format {qcfg['checkpoint_format']!r} is not supported (only v1 'gptq')")
        return QuantScheme(qcfg["bits"], qcfg["group_size"], qcfg.get("sym", True))


class AWQFormat(Format):
    """AutoAWQ GEMM: qweight [K, N/8] packed along N with the AWQ interleave; qzeros [G, N/8] (real zeros)."""

    name, marker = "awq", "qweight"

    def check(self, name, shape, scheme, trivial_g_idx=True):
        n, k = shape
        if scheme.type != "int":
            raise _fail(self.name, name, f"{scheme.type} weights (AWQ stores integer codes)", "use compressed-tensors")
        if scheme.float_zero_point:
            raise _fail(self.name, name, "float zero points (AWQ's qzeros are packed integer codes)",
                        "use compressed-tensors")
        if scheme.bits != 4:
            raise _fail(self.name, name, f"{scheme.bits}-bit weights (AWQ GEMM is 4-bit only)",
                        "use gptq or compressed-tensors")
        if not trivial_g_idx:
            raise _fail(self.name, name, "act-order permuted groups (AWQ has no g_idx)",
                        "quantize with --static-groups, or export to gptq or compressed-tensors")
        if scheme.group_size == -1:
            raise _fail(self.name, name, "per-channel scales (AWQ needs a group size)", "use gptq or compressed-tensors")
        if n % 8:
            raise _fail(self.name, name, f"{n} output features (not a multiple of 8)", "use compressed-tensors")

    def pack(self, qweight):
        out = {
            "qweight": interleave_awq(qweight.q.t()),  # [K, N/8]
            "qzeros": interleave_awq(qweight.zeros.t()),  # [G, N/8]
            "scales": qweight.scales.t().contiguous().to(SCALE_DTYPE),  # [G, N]
        }
        if qweight.bias is not None:
            out["bias"] = qweight.bias.to(SCALE_DTYPE)
        return out

    def unpack(self, tensors, scheme):
        scales = tensors["scales"].float().t().contiguous()
        n = scales.shape[0]
        q = deinterleave_awq(tensors["qweight"], n).t()
        zeros = deinterleave_awq(tensors["qzeros"], n).t()
        return QuantizedWeight(q.to(torch.uint8).contiguous(), scales, zeros.to(torch.int32).contiguous(),
                               default_g_idx(q.shape[1], scheme), scheme, stored_bias(tensors))

    def quantization_config(self, record):
        return {"quant_method": "awq", "bits": 4, "group_size": record.scheme.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}

    def scheme_from_config(self, qcfg):
        if qcfg.get("version", "gemm").lower() != "gemm":
            raise ArtifactError(f"AWQ version {qcfg['version']!r} is not supported (only 'gemm')")
        return QuantScheme(qcfg.get("bits", qcfg.get("w_bit", 4)), qcfg.get("group_size", qcfg.get("q_group_size")),
                           not qcfg.get("zero_point", True))


class CompressedTensorsFormat(Format):
    """compressed-tensors, six of its formats (each a layout in formats.ct_layouts, where a plug-in adds its own):
    - pack-quantized (weight-only): weight_packed [N, ceil(K*b/32)] of q + 2^(b-1) (signed q), packed along K;
      weight_scale [N, G]; weight_zero_point [ceil(N*b/32), G] packed along N (asymmetric only); a 2:4 weight
      stored compressed (llmopt's extension, with the config's sparsity_config) packs only its kept codes
      ([N, K/2] before packing) and adds `bitmask` [N, K/8] uint8 (core.contract.sparse24's);
    - int-quantized (W8A8: 8-bit weights with quantized input activations): weight [N, K] int8 (signed q),
      weight_scale [N, G], weight_zero_point [N, G] int8 (asymmetric only); the config group's
      input_activations says how the inputs are quantized at run time (dynamic per token);
    - naive-quantized (asymmetric int weights with a float zero point, weight-only): int-quantized's layout with
      weight_zero_point [N, G] float32 (z - 2^(b-1), real-valued) and the weights' args stating zp_dtype float32;
      compressed-tensors' own decompressor computes (q - z) * s from it as for an integer zero point;
    - float-quantized (FP8): weight [N, K] float8_e4m3fn, weight_scale [N, G]; input_activations as above (FP8
      per token for W8A8-FP8, none for W8A16-FP8);
    - nvfp4-pack-quantized (NVFP4): weight_packed [N, K/2] uint8 of E2M1 codes (core.contract.fp4), weight_scale
      [N, K/16] float8_e4m3fn, weight_global_scale [1] float32 (w = v * scale / global); with NVFP4 inputs
      (nvfp4-a4) also input_global_scale [1] float32, calibrated;
    - mxfp4-pack-quantized (MXFP4): weight_packed as NVFP4's, weight_scale [N, K/32] uint8 E8M0 exponents."""

    name, marker = "compressed-tensors", "weight_packed"  # (each layout names its own marker: ct_layouts)

    def check(self, name, shape, scheme, trivial_g_idx=True):
        if scheme.scale_format is not None and not trivial_g_idx:
            raise _fail(self.name, name, f"act-order permuted groups in {scheme.fp4_name} (its format has no g_idx)",
                        "quantize with static groups (the default)")

    def check_record(self, record):
        acts, weights = record.input_activations, record.scheme
        same_8bit = acts is not None and weights.bits == acts.bits == 8 and acts.type == weights.type
        nvfp4 = acts is not None and weights.scale_format == acts.scale_format == "e4m3"
        if acts is not None and not (same_8bit or nvfp4):
            raise ArtifactError(f"compressed-tensors holds quantized inputs with 8-bit weights of the same type or "
                                f"NVFP4 with NVFP4, not {weights.bits}-bit {weights.type} weights with "
                                f"{acts.bits}-bit {acts.type} inputs")

    @staticmethod
    def format_of(weights: QuantScheme, acts: QuantScheme | None) -> str:
        """The compressed-tensors format for these weights and inputs (formats.ct_layouts)."""
        return layout_for(weights, acts).name

    def pack(self, qweight):
        return layout_for(qweight.scheme, qweight.input_activations).pack(qweight)

    def unpack(self, tensors, scheme):
        return layout_of(tensors, scheme).unpack(tensors, scheme)

    def quantization_config(self, record):
        actorder = ("weight" if record.static_groups else "group") if record.act_order else None
        weights = {**record.scheme.to_args(), "actorder": actorder}
        acts = record.input_activations
        fmt = self.format_of(record.scheme, acts)
        return {
            "quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None if acts is None else acts.to_args(),
                                          "output_activations": None, "format": fmt}},
            "ignore": ["lm_head"], "quantization_status": "compressed", "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }

    def _group(self, qcfg):
        if qcfg.get("format") not in CT_LAYOUTS:
            raise ArtifactError(f"compressed-tensors format {qcfg.get('format')!r} is not supported "
                                f"({', '.join(CT_LAYOUTS.names())})")
        groups = list(qcfg["config_groups"].values())
        if len(groups) != 1:
            raise ArtifactError("compressed-tensors checkpoints with several config groups are not supported yet")
        return groups[0]

    def scheme_from_config(self, qcfg):
        return QuantScheme.from_args(self._group(qcfg)["weights"])

    def input_activations_from_config(self, qcfg):
        args = self._group(qcfg).get("input_activations")
        return None if not args else QuantScheme.from_args(args)

    def marker_for(self, qcfg):
        fmt = qcfg.get("format")
        return CT_LAYOUTS.get(fmt).marker if fmt in CT_LAYOUTS else self.marker


FORMATS.add("gptq", GPTQFormat())
FORMATS.add("awq", AWQFormat())
FORMATS.add("compressed-tensors", CompressedTensorsFormat())


def format_for_config(qcfg: dict) -> Format:
    method = qcfg.get("quant_method")
    if method not in FORMATS:
        raise ArtifactError(f"quantization method {method!r} in config.json is not readable: "
                            f"llmopt reads {', '.join(FORMATS.names())}")
    return FORMATS.get(method)
