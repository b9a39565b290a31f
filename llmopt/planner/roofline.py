"""The roofline of one engine instance (tp x pp devices): pure functions of a model shape, a hardware spec and a
deployment, in seconds. A phase takes max(FLOPs / compute rate, bytes / bandwidth) plus its fixed costs and its
communication: prefill is compute-bound (many tokens per weight read), decode bandwidth-bound (every step reads
every weight and each sequence's cached context for a few FLOPs per byte).

Communication: tensor parallelism all-reduces [rows, hidden] twice per layer (ring: 2 (T - 1) / T of the bytes
over the link, plus a fixed latency); pipeline parallelism sends [rows, hidden] from stage to stage. A pipeline
step of M micro-batches over S stages takes (M + S - 1) stage-times of one micro-batch (the runtime's schedule)."""

from __future__ import annotations

from dataclasses import dataclass

from llmopt.planner.device_specs import HardwareSpec
from llmopt.planner.shape import ModelShape, WeightScheme

ACTIVATION_BYTES = 2  # bf16 activations on the wire (fp32 under an fp32 scheme)


@dataclass(frozen=True)
class Instance:
    """One engine: its model, device and layout."""

    model: ModelShape
    hardware: HardwareSpec
    scheme: WeightScheme
    kv_dtype: str
    tp: int = 1
    pp: int = 1
    instances: int = 1  # engine instances of the deployment (on a CPU they share the machine)

    @property
    def ranks(self) -> int:
        return self.tp * self.pp

    @property
    def share(self) -> float:
        """The part of a device's rates one rank gets: the ranks of every instance on one CPU divide it; GPUs are
        one per rank."""
        return 1.0 / (self.ranks * self.instances) if self.hardware.kind == "cpu" else 1.0

    @property
    def activation_bytes(self) -> int:
        wide = self.scheme.name == "fp32" or (self.scheme.compute == "activations"
                                              and self.hardware.activation_dtype == "fp32")
        return 4 if wide else ACTIVATION_BYTES

    def all_reduce_time(self, rows: float) -> float:
        """One all-reduce of [rows, hidden] among the tp ranks."""
        if self.tp == 1:
            return 0.0
        hw = self.hardware
        moved = 2 * (self.tp - 1) / self.tp * rows * self.model.hidden * self.activation_bytes
        return hw.link_latency_us * 1e-6 + moved / (hw.link_gb_s * 1e9)

    def transfer_time(self, rows: float) -> float:
        """One stage-to-stage send of [rows, hidden]."""
        hw = self.hardware
        return hw.link_latency_us * 1e-6 + rows * self.model.hidden * self.activation_bytes / (hw.link_gb_s * 1e9)

    def _roofline(self, flops: float, read: float) -> float:
        """The slower of computing `flops` and reading `read` bytes, split over the tp ranks of a stage."""
        hw = self.hardware
        compute = flops / self.tp / (hw.flops(self.scheme.compute) * self.share)
        return max(compute, read / self.tp / (hw.bandwidth * self.share))

    def _layers_work(self, rows: float, sequences: float, context: float) -> tuple[float, float]:
        """(FLOPs, bytes read) of one stage's layers over `rows` new tokens of `sequences` sequences that attend to
        `context` cached tokens each on average."""
        model = self.model
        flops = rows * (model.linear_flops_per_token() + model.attention_flops_per_token(context))
        read = model.decoder_params * self.scheme.bytes_per_weight
        read += sequences * context * model.kv_bytes_per_token(self.kv_dtype)
        return flops / self.pp, read / self.pp

    def _head_work(self, sequences: float) -> tuple[float, float]:
        """(FLOPs, bytes read) of the vocabulary projection of the sampled rows."""
        model = self.model
        return sequences * model.head_flops_per_token(), model.head_params * self.scheme.dense_bytes

    def _layers_fixed(self, rows: float) -> float:
        """One stage's per-layer dispatch and its all-reduces."""
        layers = self.model.layers / self.pp
        return layers * (self.hardware.layer_overhead_us * 1e-6 + 2 * self.all_reduce_time(rows))

    def step_time(self, rows: float, sequences: float, context: float) -> float:
        """One engine step over `rows` new tokens of `sequences` sequences (decode: rows = sequences)."""
        overhead = self.hardware.step_overhead_ms * 1e-3
        head_flops, head_read = self._head_work(sequences)
        if self.pp == 1:
            flops, read = self._layers_work(rows, sequences, context)
            return self._roofline(flops + head_flops, read + head_read) + self._layers_fixed(rows) + overhead
        micro = min(self.pp, max(1, int(sequences)))  # the runtime's default: as many micro-batches as stages
        part = self._roofline(*self._layers_work(rows / micro, sequences / micro, context))
        part += self._layers_fixed(rows / micro)
        transfers = self.pp * self.transfer_time(rows / micro)
        return (micro + self.pp - 1) * part + transfers + self._roofline(head_flops, head_read) + overhead

    def decode_step(self, batch: float, context: float) -> float:
        return self.step_time(batch, batch, context)

    def prefill_time(self, prompt: int) -> float:
        """A prompt alone (its tokens attend to half the prompt on average)."""
        return self.step_time(prompt, 1, prompt / 2)

    def prefill_compute(self, prompt: int) -> float:
        """What a prompt's prefill adds to decode steps it is batched into: its FLOPs (the weights are read by the
        decode anyway)."""
        model, hw = self.model, self.hardware
        flops = prompt * (model.linear_flops_per_token() + model.attention_flops_per_token(prompt / 2))
        return flops / self.ranks / (hw.flops(self.scheme.compute) * self.share)

    def weight_memory(self) -> float:
        """Bytes of weights each rank holds."""
        return self.model.stored_bytes(self.scheme) / self.ranks

    def kv_memory(self, tokens: float) -> float:
        """Bytes of KV cache each rank holds for `tokens` cached tokens in all."""
        return tokens * self.model.kv_bytes_per_token(self.kv_dtype) / self.ranks

    def device_memory(self) -> float:
        """Usable bytes per rank (ranks on one CPU divide its memory)."""
        return self.hardware.memory_bytes * self.share

    def max_batch(self, tokens_per_sequence: int) -> int:
        """Sequences of `tokens_per_sequence` whose cache fits beside the weights (0: the weights do not fit)."""
        free = self.device_memory() - self.weight_memory()
        if free <= 0:
            return 0
        return int(free // self.kv_memory(tokens_per_sequence))
