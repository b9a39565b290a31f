"""How a tensor is quantized, typed: one frozen `QuantScheme` describes a weight, a linear's input activations or
the KV cache, modelled on compressed-tensors' `QuantizationArgs` (num_bits, type, strategy, group_size,
symmetric, dynamic, observer). A `LinearScheme` pairs a linear's weights with its input activations; presets name
the usual pairs (w4a16, w8a16, w4a8); `kv_cache` schemes stand apart, as compressed-tensors' `kv_cache_scheme`.

Today's integer weight schemes keep their short constructor, QuantScheme(bits, group_size, sym): the strategy
follows from the group size (group_size -1 = one group per output channel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from llmopt.core.contract.grid import grid_names, weight_grid
from llmopt.core.errors import ConfigError

SUPPORTED_BITS = (2, 3, 4, 8)
FLOAT_BITS = (4, 8)  # float schemes: FP8 E4M3 (values up to +-448), FP4 E2M1 (up to +-6)
FLOAT8_MAX = 448.0
FLOAT4_MAX = 6.0
# FP4's two block formats, as compressed-tensors tells them apart (by group size and scale dtype): NVFP4 = blocks
# of 16 with E4M3 scales under one FP32 global scale per tensor (strategy tensor_group); MXFP4 = blocks of 32 with
# power-of-two E8M0 scales (strategy group)
FP4_BLOCKS = {"tensor_group": 16, "group": 32}
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group")
OBSERVERS = ("minmax", "mse")
ZERO_POINTS = ("int", "float")


@dataclass(frozen=True)
class QuantScheme:
    """bits: code width; group_size: consecutive input columns sharing a scale (-1: a whole row); sym: zero point
    fixed at the middle of the code range; type: the number format of the codes, a weight grid's name
    (core.contract.grid: int codes, a float format (E4M3, E2M1), or a registered grid's); strategy: what one scale
    covers (None: group when group_size > 0, else channel); dynamic: scales computed at run time from the tensor
    itself (activations), not stored; observer: how a static range is chosen (min/max, or the error-minimising
    search); zero_point: of an asymmetric int scheme, an integer code (GPTQ, AWQ and compressed-tensors pack them
    as codes) or any real number, i.e. a float minimum per group, w = s * q + m with m = -s * z (GGUF Q4_1's and
    K-quants' parametrisation): the group's range need not contain 0 nor start on a code."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    type: str = "int"  # a weight grid's name (core.contract.grid): "int", "float" or a registered one
    strategy: Literal["tensor", "channel", "group", "block", "token"] | None = None
    dynamic: bool = False
    observer: Literal["minmax", "mse"] = field(default="minmax", compare=False)  # how, not what: not compared
    zero_point: Literal["int", "float"] = "int"

    def __post_init__(self):
        if self.strategy is None:
            object.__setattr__(self, "strategy", "group" if self.group_size > 0 else "channel")
        for name, allowed in (("type", grid_names()), ("strategy", STRATEGIES), ("observer", OBSERVERS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"scheme {name} {getattr(self, name)!r}: choose one of {', '.join(allowed)}")
        if self.zero_point not in ZERO_POINTS:
            raise ConfigError(f"zero point {self.zero_point!r}: choose one of {', '.join(ZERO_POINTS)}")
        if self.float_zero_point and (self.sym or self.type != "int"):
            raise ConfigError("a float zero point belongs to asymmetric integer schemes: quantize with --asym (a "
                              "symmetric scheme's zero point is fixed, a float grid has none)")

    @property
    def float_zero_point(self) -> bool:
        return self.zero_point == "float"

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    @property
    def float_max(self) -> float:
        """The largest magnitude a float scheme's values take (FP8 E4M3: 448, FP4 E2M1: 6)."""
        return FLOAT4_MAX if self.bits == 4 else FLOAT8_MAX

    @property
    def scale_format(self) -> str | None:
        """How an FP4 scheme stores its block scales: "e4m3" (NVFP4, under a global scale) or "e8m0" (MXFP4,
        powers of two); None for other schemes (float32 scales, stored as fp16)."""
        if self.type != "float" or self.bits != 4:
            return None
        return "e4m3" if self.strategy == "tensor_group" else "e8m0"

    @property
    def fp4_name(self) -> str:
        return "nvfp4" if self.strategy == "tensor_group" else "mxfp4"

    def check(self, in_features: int, name: str = "layer") -> None:
        """Raise ConfigError saying why this scheme cannot quantize a linear with `in_features` columns: its grid's
        limits (core.contract.grid), then the group size."""
        weight_grid(self.type).check(self, in_features, name)
        if self.group_size != -1 and (self.group_size < 1 or in_features % self.group_size):
            fits = next(g for g in (self.group_size // 2 ** k for k in range(64)) if g <= 1 or in_features % g == 0)
            raise ConfigError(
                f"--group-size {self.group_size} does not divide {name}'s in_features ({in_features}): "
                f"give --group-size {max(fits, 1)} (a divisor of it) or -1 (per channel)"
            )

    def to_args(self) -> dict:
        """compressed-tensors' QuantizationArgs fields for this scheme."""
        args = {"num_bits": self.bits, "type": self.type, "symmetric": self.sym, "strategy": self.strategy,
                "group_size": self.group_size if self.strategy in ("group", "tensor_group") else None,
                "dynamic": self.dynamic, "observer": None if self.dynamic else self.observer}
        if self.float_zero_point:  # a real zero point per group, stored as float32 (compressed-tensors' zp_dtype)
            args["zp_dtype"] = "torch.float32"
        if self.dynamic and self.strategy == "tensor_group":
            # NVFP4 inputs: block scales computed at run time ("local"), the global scale calibrated (static)
            args.update(dynamic="local", observer="static_minmax")
        if self.scale_format is not None:  # the block scales' storage dtype, as llm-compressor's presets state it
            args["scale_dtype"] = "torch.float8_e4m3fn" if self.scale_format == "e4m3" else "torch.uint8"
        return args

    @classmethod
    def from_args(cls, args: dict) -> QuantScheme:
        """From compressed-tensors' QuantizationArgs (a config.json's `weights` / `input_activations`)."""
        strategy = args.get("strategy") or ("group" if args.get("group_size") else "channel")
        group = args.get("group_size") if strategy in ("group", "tensor_group") else -1
        observer = args.get("observer") if args.get("observer") in OBSERVERS else "minmax"
        kind = args.get("type", "int")
        zp_dtype = str(args.get("zp_dtype") or "")
        zero_point = "float" if kind == "int" and "float" in zp_dtype and not args.get("symmetric", True) else "int"
        return cls(args.get("num_bits", 8), group or -1, args.get("symmetric", True), kind,
                   strategy, args.get("dynamic") in (True, "local"), observer, zero_point)


# Dynamic 8-bit activations, one symmetric scale per group of 64 input columns (the int4 kernels' block): the
# scheme of llama.cpp's Q8 activations.
INT8_GROUP_ACTIVATIONS = QuantScheme(8, 64, True, strategy="group", dynamic=True)
# Dynamic 8-bit activations, one symmetric scale per token (row): W8A8's inputs, as llm-compressor's W8A8 preset
# and vLLM's int8 kernels take them.
INT8_TOKEN_ACTIVATIONS = QuantScheme(8, -1, True, strategy="token", dynamic=True)
# FP8 (E4M3) weights per output channel, and dynamic FP8 activations per token: llm-compressor's FP8_DYNAMIC
FP8_CHANNEL_WEIGHTS = QuantScheme(8, -1, True, type="float")
FP8_TOKEN_ACTIVATIONS = QuantScheme(8, -1, True, type="float", strategy="token", dynamic=True)
# FP4 (E2M1) weights in blocks: NVFP4 (16, E4M3 scales, a global FP32 scale) and MXFP4 (32, E8M0 scales)
NVFP4_WEIGHTS = QuantScheme(4, 16, True, type="float", strategy="tensor_group")
MXFP4_WEIGHTS = QuantScheme(4, 32, True, type="float", strategy="group")
# NVFP4 inputs: E2M1 in blocks of 16 along each token's columns, E4M3 block scales computed at run time under a
# global scale calibrated per linear (compressed-tensors' dynamic "local", llm-compressor's NVFP4 preset)
NVFP4_ACTIVATIONS = QuantScheme(4, 16, True, type="float", strategy="tensor_group", dynamic=True)


@dataclass(frozen=True)
class LinearScheme:
    """A linear layer's numerics: its weights' scheme (None: dense, in the compute dtype) and its input
    activations' (None: the compute dtype). The runtime's linear methods are chosen by it."""

    weights: QuantScheme | None = None
    input_activations: QuantScheme | None = None


PRESETS: dict[str, LinearScheme] = {
    "w4a16": LinearScheme(QuantScheme(4, 128)),
    "w8a16": LinearScheme(QuantScheme(8, -1)),
    "w4a8": LinearScheme(QuantScheme(4, 128), INT8_GROUP_ACTIVATIONS),
    # per-channel symmetric int8 weights, per-token dynamic symmetric int8 inputs: integer dot products
    "w8a8-int8": LinearScheme(QuantScheme(8, -1, True), INT8_TOKEN_ACTIVATIONS),
    "w8a16-fp8": LinearScheme(FP8_CHANNEL_WEIGHTS),
    "w8a8-fp8": LinearScheme(FP8_CHANNEL_WEIGHTS, FP8_TOKEN_ACTIVATIONS),
    "nvfp4": LinearScheme(NVFP4_WEIGHTS),  # weights only (llm-compressor's NVFP4A16)
    "mxfp4": LinearScheme(MXFP4_WEIGHTS),  # weights only (MXFP4A16)
    "nvfp4-a4": LinearScheme(NVFP4_WEIGHTS, NVFP4_ACTIVATIONS),  # and FP4 inputs (llm-compressor's NVFP4)
}
# the presets `llmopt quantize --scheme` takes (w4a8 is a runtime choice: --input-activations int8)
QUANTIZE_PRESETS = ["w4a16", "w8a16", "w8a8-int8", "w8a16-fp8", "w8a8-fp8", "nvfp4", "mxfp4", "nvfp4-a4"]


def register_preset(name: str, scheme: LinearScheme, quantize: bool = True) -> LinearScheme:
    """Name a linear scheme (a plug-in grid's, say) so configs and `--scheme` take it; quantize: `llmopt quantize
    --scheme` offers it (else it is a runtime choice only)."""
    if name in PRESETS:
        raise ConfigError(f"scheme preset {name!r} registered twice")
    PRESETS[name] = scheme
    if quantize:
        QUANTIZE_PRESETS.append(name)
    return scheme


def unregister_preset(name: str) -> LinearScheme:
    """Remove a registered preset (a test's plug-in, once the test is done)."""
    if name in QUANTIZE_PRESETS:
        QUANTIZE_PRESETS.remove(name)
    return PRESETS.pop(name)


def preset(name: str) -> LinearScheme:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown scheme {name!r}: choose one of {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class QuantRecord:
    """What a quantized checkpoint records beyond the scheme: how the codes were found. Built from a method's
    typed config (`from_config`), never from an untyped dict with defaults of its own."""

    scheme: QuantScheme
    method: str
    act_order: bool = False
    static_groups: bool = True  # with act_order: groups stay k // group_size (g_idx trivial)
    damp: float | None = None  # GPTQ's dampening, when the method has one
    true_sequential: bool = True
    input_activations: QuantScheme | None = None  # quantized inputs the checkpoint asks for (W8A8), else None

    @classmethod
    def from_config(cls, scheme: QuantScheme, settings: dict,
                    input_activations: QuantScheme | None = None) -> QuantRecord:
        """From a method config's fields (its model_dump, as llmopt.json keeps it); fields a method lacks keep
        the values that describe it (no act-order, trivial groups)."""
        return cls(scheme, settings.get("method", "rtn"), bool(settings.get("act_order", False)),
                   bool(settings.get("static_groups", True)), settings.get("damp"),
                   bool(settings.get("true_sequential", True)), input_activations)
