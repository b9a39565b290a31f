"""KV-cache bytes per token: DeepSeek's multi-head latent attention against standard multi-head attention on the
same model, computed from configs (no weights): tiny-random-deepseek, and DeepSeek-V2-Lite's published config.

MLA caches kv_lora_rank + qk_rope_head_dim values per token and layer (the runtime's `latent` KVCacheSpec);
the same model with multi-head attention would cache each head's key (qk_nope_head_dim + qk_rope_head_dim) and
value (v_head_dim). For the tiny model the MLA figure is also read off a running engine.

    python benchmarks/runtime/kv_bytes.py --json docs/results/data/kv_bytes.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmopt.core.tiny import TINY_CONFIGS
from llmopt.runtime.executor.attention import KVCacheSpec
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

# DeepSeek-V2-Lite (config.json of deepseek-ai/DeepSeek-V2-Lite): the attention fields only
DEEPSEEK_V2_LITE = dict(num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, q_lora_rank=None,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def per_token(config: dict, dtype: torch.dtype) -> dict:
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    mla = KVCacheSpec("latent", layers, dtype, latent_dim=config["kv_lora_rank"],
                      rope_dim=config["qk_rope_head_dim"]).bytes_per_token
    element = torch.tensor([], dtype=dtype).element_size()
    mha = layers * heads * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"]) * element
    return {"mla_bytes_per_token": mla, "mha_bytes_per_token": mha, "ratio": mla / mha}


def engine_figure() -> int:
    from llmopt.core.tiny import build_tiny_model
    from llmopt.runtime.engine.config import EngineConfig
    from llmopt.runtime.engine.engine import Engine

    model, tok = build_tiny_model("deepseek")
    return Engine(model, tok, EngineConfig(kv_cache_bytes=1 << 20)).kv_cache_info()["bytes_per_token"]


def main() -> None:
    parser = command_line(__doc__, type=Path)
    args = parser.parse_args()
    rows = {}
    for name, config, dtype in (("tiny-random-deepseek (fp32)", TINY_CONFIGS["deepseek"], torch.float32),
                                ("DeepSeek-V2-Lite (bf16)", DEEPSEEK_V2_LITE, torch.bfloat16)):
        rows[name] = per_token(config, dtype)
    rows["tiny-random-deepseek (fp32)"]["engine_bytes_per_token"] = engine_figure()
    print("| model | MLA bytes/token | MHA bytes/token | MLA / MHA |")
    print("|---|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['mla_bytes_per_token']:,} | {row['mha_bytes_per_token']:,} | {row['ratio']:.4f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
