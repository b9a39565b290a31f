"""Experiment: does torch.compile of the decode step pay off on this CPU? Decode-only steps of the runtime's fast
path, eager vs one compiled layer function (called once per layer) vs one compiled function over all layers.
Prefill steps stay eager. The compiled variants must give the same tokens as eager (printed).

    python benchmarks/compile_decode.py --model /tmp/q --batch 1 [--json out.json]

(`/tmp/q`: a GPTQ w4 artifact of SmolLM2, loaded with the packed int4 kernels; `--model smollm2-135m` for bf16.)
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F

from llmopt.core.hardware import cpu_line
from llmopt.core.models import load_model
from llmopt.runtime import model as runtime_model
from llmopt.runtime.engine import Engine, EngineConfig
from llmopt.runtime.sampling import SamplingParams


def decode_layer(decoder, h, cos, sin, k_cache, v_cache, slot_mapping, block_tables, mask, block):
    """The fast path's decode-only layer (RuntimeDecoder.forward + store_kv + _attend_decodes), as one traceable
    function. Written out rather than calling those: under dynamic=True `_attend_decodes` derives SDPA's
    enable_gqa from q's (symbolic) shape, which SDPA rejects, and a new metadata object per step would fail
    dynamo's guards; here the head counts are plain ints and only tensors go in."""
    nq, nkv, hd = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
    t = h.shape[0]
    qkv = block.qkv(runtime_model._rms_norm_fast(block.input_norm, h))
    qk = qkv[:, : (nq + nkv) * hd].view(t, nq + nkv, hd)
    qk = qk * cos + runtime_model.rotate_half(qk) * sin
    q, k = qk[:, :nq], qk[:, nq:]
    v = qkv[:, (nq + nkv) * hd:].view(t, nkv, hd)
    k_cache.view(-1, nkv, hd)[slot_mapping] = k
    v_cache.view(-1, nkv, hd)[slot_mapping] = v
    num_blocks, block_size = k_cache.shape[:2]
    flat = block_tables.reshape(-1)
    shape = (t, block_tables.shape[1] * block_size, nkv, hd)
    keys = k_cache.view(num_blocks, -1).index_select(0, flat).view(shape).transpose(1, 2)
    values = v_cache.view(num_blocks, -1).index_select(0, flat).view(shape).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=decoder.scale,
                                       enable_gqa=nq != nkv)[:, :, 0]
    h = h + block.o_proj(o.reshape(t, -1))
    gate, up = block.gate_up(runtime_model._rms_norm_fast(block.post_norm, h)).chunk(2, dim=-1)
    return h + block.down_proj(F.silu(gate) * up)


def install(decoder, variant: str) -> None:
    """Replace the decoder's forward for decode-only steps by the variant."""
    eager_forward = decoder.forward

    def all_layers(h, cos, sin, kv_caches, slot_mapping, block_tables, mask):
        for block, (k_cache, v_cache) in zip(decoder.blocks, kv_caches):
            h = layer(decoder, h, cos, sin, k_cache, v_cache, slot_mapping, block_tables, mask, block)
        return h

    layer = torch.compile(decode_layer, dynamic=True) if variant == "compiled layer" else decode_layer
    run = torch.compile(all_layers, dynamic=True) if variant == "compiled model" else all_layers

    def forward(input_ids, positions, meta, kv_caches):
        if meta.prefills or meta.decode is None:
            return eager_forward(input_ids, positions, meta, kv_caches)
        h = decoder.embed(input_ids)
        cos, sin = decoder.rotary(h.unsqueeze(0), positions.unsqueeze(0))
        h = run(h, cos[0].unsqueeze(1), sin[0].unsqueeze(1), kv_caches, meta.slot_mapping,
                meta.decode.block_tables, meta.decode.mask)
        return decoder._norm(decoder.norm, h)

    decoder.forward = forward


def measure(model_name: str, batch: int, variant: str, steps: int) -> dict:
    packed = model_name != "smollm2-135m"
    model, tokenizer, _ = load_model(model_name, dtype="bfloat16", packed_kernels=packed)
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=batch, kv_cache_bytes=1 << 30))
    if variant != "eager":
        install(engine.runner.decoder, variant)
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(128)],
                           SamplingParams(max_tokens=3 * steps + 16, ignore_eos=True))
    start = time.perf_counter()
    while any(s.num_output_tokens == 0 for s in engine.sequences.values()):
        engine.step()
    for _ in range(5):  # compiles here
        engine.step()
    warmup = time.perf_counter() - start
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times.append((time.perf_counter() - start) / steps * 1e3)
    first = next(iter(engine.sequences.values()))
    return {"variant": variant, "batch": batch, "warmup_s": round(warmup, 1),
            "ms_per_step": [round(t, 2) for t in times], "tokens": first.token_ids[128:140]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--variants", default="eager,compiled layer,compiled model")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for variant in args.variants.split(","):
        try:
            rows.append(measure(args.model, args.batch, variant, args.steps))
        except Exception as e:  # a failed compile is a result too
            rows.append({"variant": variant, "batch": args.batch, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_line(), "model": args.model, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
