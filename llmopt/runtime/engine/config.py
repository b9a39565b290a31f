"""The runtime's one config object, from the CLI to the scheduler, and its defaults (defined here once;
importing this module does not import torch, so the CLI can show the defaults in its help)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, Optional, get_type_hints

from llmopt.core.contract.scheme import INT8_GROUP_ACTIVATIONS
from llmopt.core.errors import ConfigError

# The KV cache's default size: this fraction of the memory available when the engine starts (CPU: the host's
# available memory; CUDA: the device's free memory after the weights), as vLLM's VLLM_CPU_KVCACHE_SPACE /
# gpu_memory_utilization size it from the machine. On CPU the cache is zero pages that the OS commits as blocks
# are first written, so an unused budget costs address space, not memory.
KV_CACHE_MEMORY_FRACTION = 0.25
# engine processes (ranks, stages, replicas, workers) a start may ask for per core this process may use; more only
# with --oversubscribe: past it they only take turns on the cores, and a typo (--data-parallel-size 1000) would
# start hundreds
PROCESSES_PER_CORE = 4
KV_CACHE_MAX_FRACTION = 0.95  # the rest stays for weights, activations and the OS

SPECULATIVE_METHODS = ("ngram", "draft", "medusa")
MEDUSA_HEADS_FILE = "medusa_heads.safetensors"  # next to the model, or named by --speculative medusa:PATH


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses the next tokens, the target verifies them in one forward.

    method: ngram (prompt lookup: copy what followed the last n tokens where they occurred before), draft (a
    smaller model with the same tokenizer, `model` its path), medusa (extra heads on the target's last hidden
    state, `model` the heads' file). adaptive: per sequence, speculate only as many tokens as its acceptance
    pays for at the measured cost of a token in this batch (large batches are compute-bound)."""

    method: Literal["ngram", "draft", "medusa"] = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 5
    ngram_min: int = 1
    ngram_max: int = 4
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)} "
                             f"(got {self.method!r})")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"--num-speculative-tokens must be >= 1 (got {self.num_speculative_tokens})")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= --ngram-min <= --ngram-max (got {self.ngram_min}, {self.ngram_max})")
        if self.method == "draft" and not self.model:
            raise ConfigError("--speculative draft needs its model: draft:MODEL")

    @classmethod
    def parse(cls, text: str, **fields) -> SpeculativeConfig:
        """From the CLI's form: ngram, draft:MODEL, medusa or medusa:PATH."""
        method, _, model = text.partition(":")
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative {text!r}: use ngram, draft:MODEL or medusa[:PATH]")
        if method == "ngram" and model:
            raise ConfigError(f"--speculative {text!r}: ngram takes no model")
        return cls(method, model or None, **fields)


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
KV_CACHE_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float8": "fp8",
                          "fp8_e4m3": "fp8"}
KV_CACHE_8BIT = ("int8", "fp8")  # codes with a scale per token and KV head (runtime/executor/kernels/kv_quant.py)
KV_CACHE_COMMIT_MODES = ("lazy", "background", "startup")  # runtime/executor/attention/kv_commit.py
ACTIVATION_MODES = ("auto", "float", "int8")
LINEAR_KERNEL_MODES = ("measured", "fixed")  # how quantized linears pick a kernel per row count (kernel_plans.py)
# EngineConfig.activations -> the input-activation scheme linear methods are chosen for (None: the compute dtype)
ACTIVATION_SCHEMES = {"float": None, "int8": INT8_GROUP_ACTIVATIONS}
LM_HEAD_GROUPS = {"int8": -1, "int8-g32": 32}  # --lm-head -> the columns per scale of its int8 rounding (-1: a row)


def option(default, help: str, flag: str | None = None, numerics: bool = False, aliases: tuple[str, ...] = ()):
    """A config field that is also a CLI option of generate, bench and serve and a key of a recipe's
    `bench.engine` section (cli.options.engine_options reads these). flag: the option's name when it is not the
    field's (`--FLAG`, `--FLAG/--no-FLAG` for booleans); aliases: former names it still answers to; numerics: the
    setting changes the numbers the model computes (recorded with every bench result and in the server's
    /v1/models)."""
    return field(default=default, metadata={"help": help, "flag": flag, "numerics": numerics, "aliases": aliases})


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches, caches and computes: every engine setting, declared once. The CLI's engine
    options and the recipe schema's engine section are generated from these fields (types, defaults, help)."""

    block_size: int = option(16, "Tokens per KV-cache block.")
    kv_cache_bytes: Optional[int] = option(
        None, "KV cache size in bytes (default: --kv-cache-memory-fraction of the available memory, capped at what "
        "--max-num-seqs full-context sequences can fill).")
    kv_cache_tokens: Optional[int] = option(
        None, "KV cache size in tokens (whole blocks), as llama.cpp's --ctx-size sizes its cache; instead of "
        "--kv-cache-bytes.")
    kv_cache_memory_fraction: float = option(
        KV_CACHE_MEMORY_FRACTION, "Default KV cache size as a fraction of the memory available at start (host "
        "memory on CPU, free device memory on CUDA).")
    kv_cache_dtype: str = option(
        "auto", "dtype of the cached keys and values: auto (the model's), float32|fp32, bfloat16|bf16, "
        "float16|fp16, int8 or fp8 (8-bit codes with an fp32 scale per token and KV head: ~3.8x the tokens of fp32 "
        "in the same bytes).", numerics=True)
    kv_cache_commit: Literal["lazy", "background", "startup"] = option(
        "background", "When a CPU KV cache's memory is committed (it starts as zero pages the OS commits on first "
        "write, which on VMs that back memory lazily costs tens of ms per 2 MiB inside a step): background (a thread "
        "at idle priority commits it from the first block up while a core is free), startup (all of it before the "
        "engine starts: seconds per GB on such VMs) or lazy (the step that first writes a block).")
    max_num_seqs: int = option(64, "Sequences in one step at most.")
    max_num_batched_tokens: int = option(2048, "Tokens in one step at most (prefill chunks + decodes).")
    enable_chunked_prefill: bool = option(True, "Split long prompts into chunks that share steps with decodes.",
                                          flag="chunked-prefill")
    enable_prefix_cache: bool = option(True, "Reuse the KV blocks of prompt prefixes seen before.",
                                       flag="prefix-cache")
    policy: Literal["continuous", "static"] = option(
        "continuous", "continuous: requests join and leave every step; static: a batch runs until all finish.",
        flag="batching")
    fast_path: Optional[bool] = option(
        None, "Fused projections and compiled kernels (same maths, another rounding order); --no-fast-path runs "
        "transformers' numerics token for token in fp32. Default: on where fused kernels exist (CPU; CUDA with "
        "Triton).",
        flag="fast-path", numerics=True)
    activations: Literal["auto", "float", "int8"] = option(
        "auto", "The inputs of weight-only quantized linears. int8: int4 and int8 weight-only linears (and an int8 "
        "logits head) at decode (up to 16 rows; beyond, where it measures faster) round their inputs to 8 bits per "
        "block of 32 (dynamic, symmetric) and multiply integers, as llama.cpp's Q8 activations do (int4: ~0.5% error "
        "per output, +0.2% wikitext2 ppl, 2-3x faster linears); float: inputs in the compute dtype; auto: int8 on "
        "CPU with the fast path, else float. (Formerly --int4-activations, still taken.)",
        flag="input-activations", aliases=("int4-activations",), numerics=True)
    lm_head: Literal["model", "int8", "int8-g32"] = option(
        "model", "The logits head (vocab x hidden, the largest single weight of a small model): model (as the "
        "checkpoint has it), int8 (rounded at load to int8 per vocabulary row, symmetric round-to-nearest as "
        "`llmopt quantize --method rtn --bits 8` rounds, and multiplied as the int8 linears are: with 8-bit inputs "
        "where --input-activations gives them; a quarter of fp32's bytes per token, as llama.cpp's quantized output "
        "tensor) or int8-g32 (the same with a scale per 32 columns, llama.cpp's Q8_0: a third of int8's weight error "
        "on SmolLM2's head for 1/8 more bytes; needs 8-bit inputs).", flag="lm-head", numerics=True)
    linear_kernels: Literal["measured", "fixed"] = option(
        "measured", "How quantized linears pick their kernel for each step's row count: measured (every path timed "
        "once per layer shape on this machine at start, kept in $LLMOPT_HOME/kernels/) or fixed (built-in row "
        "thresholds: the same choice on every machine).", numerics=True)
    decode_graph: Optional[bool] = option(
        None, "Decode steps of up to 16 sequences run the decoder's layers as one compiled call (the same kernels in "
        "the same order, so the same numbers: no Python between them; CPU fast path, one process). Default: wherever "
        "the engine allows it; --decode-graph refuses to start where it does not; --no-decode-graph runs the same "
        "steps layer by layer from Python.", flag="decode-graph")
    enforce_eager: bool = option(
        False, "Run every step eagerly: no decode steps replayed from captured graphs (CUDA graphs, one per batch "
        "size bucket up to --max-num-seqs; on by default on CUDA).")
    attention_backend: str = option(
        "auto", "Paged attention kernels: torch (the reference), cpu (compiled), triton (CUDA), latent-torch (MLA), "
        "or any registered backend (`llmopt env` lists them); auto: the fastest the device, the model's cache and "
        "--fast-path allow.", numerics=True)
    tensor_parallel_size: int = option(
        1, "Ranks the model's matrix products are split over (one process each: rank 0 is this one, the others "
        "are spawned, or launched by torchrun). Partial sums add in another order: fp32 logits within ~1e-6 (with "
        "--input-activations float; 8-bit inputs rounded from such sums can flip a code).",
        numerics=True)
    pipeline_parallel_size: int = option(
        1, "Pipeline stages, one process each holding a contiguous run of layers; each step's sequences are cut "
        "into micro-batches that flow through the stages together (throughput, not batch-1 latency). With "
        "--tensor-parallel-size T each stage is T ranks: T x stages processes.")
    pipeline_micro_batches: Optional[int] = option(
        None, "Micro-batches per step under pipeline parallelism (default: the number of stages).")
    tp_cores: Optional[str] = option(
        None, "CPU cores of each rank (tensor-parallel ranks, pipeline stages, or both: stage by stage), "
        "';'-separated lists (\"0-3;4-7\"). Default: an even split of the cores this process may use.")
    data_parallel_size: int = option(
        1, "Engine replicas, one process each on its own cores (serve and bench), behind one front that routes each "
        "request to the least loaded replica or to one holding its prompt's prefix.")
    dp_cores: Optional[str] = option(
        None, "CPU cores of each data-parallel replica, ';'-separated lists. Default: an even split.")
    disaggregate: Optional[str] = option(
        None, "Prefill/decode disaggregation P:D (serve and bench), e.g. 1:1: P prefill workers compute each prompt's "
        "KV and hand it over (torch.distributed, gloo) to one of D decode workers, which only decode; each worker "
        "a process on its own cores. Default: colocated (chunked prefill shares steps with decodes).")
    pd_cores: Optional[str] = option(
        None, "CPU cores of each disaggregated worker, prefill workers first, ';'-separated lists. Default: an "
        "even split.")
    adaptive_threads: bool = option(
        True, "On CPU, torch's thread count follows the cores other processes leave free (measured each second): "
        "beside a busy process a step's equal shares would each wait for the thread that shares its core. "
        "--no-adaptive-threads keeps the count fixed.", flag="adaptive-threads")
    oversubscribe: bool = option(
        False, "Start more engine processes (tensor-parallel ranks, pipeline stages, replicas, disaggregated workers) "
        f"than {PROCESSES_PER_CORE} per core this process may use; refused by default: past that they only take "
        "turns on the cores.")
    speculative: Optional[SpeculativeConfig] = None  # its own options (cli.options.SPECULATIVE_OPTIONS)

    def __post_init__(self):
        dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        object.__setattr__(self, "kv_cache_dtype", dtype)  # one spelling from here on
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "data_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})",
                                  param=name)
        if self.pipeline_micro_batches is not None and self.pipeline_micro_batches < 1:
            raise ConfigError(f"--pipeline-micro-batches must be at least 1 (got {self.pipeline_micro_batches})",
                              param="pipeline_micro_batches")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ConfigError(f"--kv-cache-bytes must be positive (got {self.kv_cache_bytes})",
                              param="kv_cache_bytes")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ConfigError(f"--kv-cache-tokens must be positive (got {self.kv_cache_tokens})",
                              param="kv_cache_tokens")
        if self.kv_cache_tokens is not None and self.kv_cache_bytes is not None:
            raise ConfigError("--kv-cache-tokens and --kv-cache-bytes both size the KV cache: give one",
                              param="kv_cache_tokens")
        if not 0 < self.kv_cache_memory_fraction <= KV_CACHE_MAX_FRACTION:
            raise ConfigError(f"--kv-cache-memory-fraction {self.kv_cache_memory_fraction}: give a fraction in "
                              f"(0, {KV_CACHE_MAX_FRACTION}]", param="kv_cache_memory_fraction")
        if self.disaggregate is not None:
            self._check_disaggregation()
        # (attention_backend: checked against the backends' registry when the engine starts)
        for name, allowed in (("policy", ("continuous", "static")), ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("kv_cache_commit", KV_CACHE_COMMIT_MODES),
                              ("activations", ACTIVATION_MODES), ("linear_kernels", LINEAR_KERNEL_MODES)):
            if getattr(self, name) not in allowed:
                flag = engine_flag(name)
                raise ConfigError(f"--{flag} must be one of {', '.join(allowed)} (got {getattr(self, name)!r})",
                                  param=name)

    def activations_on(self, device: str) -> str:
        """`activations` with auto resolved: int8 on CPU when the fast path runs (its default there), else float
        (the exact mode keeps transformers' numerics)."""
        if self.activations != "auto":
            return self.activations
        return "int8" if str(device).split(":")[0] == "cpu" and self.fast_path is not False else "float"

    @property
    def disaggregation(self) -> tuple[int, int] | None:
        """(prefill workers, decode workers) under --disaggregate P:D, else None."""
        if self.disaggregate is None:
            return None
        prefill, _, decode = self.disaggregate.partition(":")
        return int(prefill), int(decode)

    def _check_disaggregation(self) -> None:
        prefill, sep, decode = self.disaggregate.partition(":")
        if not (sep and prefill.isdigit() and decode.isdigit() and int(prefill) >= 1 and int(decode) >= 1):
            raise ConfigError(f"--disaggregate {self.disaggregate!r}: give prefill:decode worker counts, e.g. 1:1",
                              param="disaggregate")
        for name, flag in (("data_parallel_size", "data-parallel-size"), ("tensor_parallel_size",
                           "tensor-parallel-size"), ("pipeline_parallel_size", "pipeline-parallel-size")):
            if getattr(self, name) > 1:
                raise ConfigError(f"--disaggregate runs one engine per worker: drop --{flag}", param="disaggregate")
        if self.speculative is not None:
            raise ConfigError("--disaggregate does not speculate (the decode workers have no draft state for the "
                              "handed-over prompts): drop --speculative", param="disaggregate")

    @property
    def quantized_kv_cache(self) -> bool:
        return self.kv_cache_dtype in KV_CACHE_8BIT

    def numerics(self) -> dict:
        """The settings that change the numbers computed (with the bench JSON and the server's /v1/models)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("numerics")}


def engine_fields() -> list:
    """EngineConfig's fields that are options (all but `speculative`), in declaration order."""
    return [f for f in fields(EngineConfig) if "help" in f.metadata]


def engine_field_types() -> list[tuple]:
    """(field, its type) for each of engine_fields(): what the CLI options and the recipe section are made of."""
    hints = get_type_hints(EngineConfig)
    return [(f, hints[f.name]) for f in engine_fields()]


def engine_flag(name: str) -> str:
    """The CLI flag of an EngineConfig field, without dashes: its `flag` or the field's name in kebab case."""
    meta = EngineConfig.__dataclass_fields__[name].metadata
    return meta.get("flag") or name.replace("_", "-")


ENGINE_DEFAULTS = EngineConfig()  # what the CLI and recipes show as defaults
