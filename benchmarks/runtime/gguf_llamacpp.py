"""llmopt's GGUF export run by llama.cpp (llama-cpp-python, built from source for this CPU): wikitext2 perplexity
of llmopt's GPTQ and RTN int4 codes exported to GGUF (symmetric: Q4_0, asymmetric with integer or float zero points:
Q4_1) against llama.cpp's own quantizers (Q4_0, Q4_1, Q4_K_M, and Q4_1 with an F16 embedding) applied to the same
fp32 model exported as an F32 GGUF, all scored by llama.cpp on the same windows; the
same artifacts scored by llmopt (transformers forward over the artifact's weights): the export must agree within
1%; and the greedy tokens of llama.cpp vs llmopt's runtime on the exported GPTQ weights.

`--rotate R1` first folds a random rotation of the residual stream into the fp model (compress.rotation: the same
function, weights off any grid an earlier quantization left) and runs every row on that model.

    python benchmarks/runtime/gguf_llamacpp.py --json docs/results/data/gguf-llamacpp.json [--model smollm2-135m]
        [--max-tokens 16384] [--seqlen 512]
        [--only gptq,rtn,gptq-asym,rtn-asym,gptq-fzp,rtn-fzp,Q4_0,Q4_1,Q4_K_M,Q4_1-f16emb,f32] [--rotate R1[,R2]]
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import torch
from peers import llamacpp_quantize  # (benchmarks/runtime/peers.py)

from llmopt.compress.api import make_config, rotate, rotation_config
from llmopt.core.datasets import tokenize_corpus
from llmopt.core.hardware import cpu_line
from llmopt.core.io import write_json
from llmopt.core.models import load_tokenizer, resolve_model
from llmopt.eval.perplexity import perplexity
from llmopt.formats.gguf import export_gguf
from llmopt.formats.load import load_model
from llmopt.formats.read import load_artifact_model
from llmopt.jobs.quantize import quantize_to_artifact
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.loader import load_runtime_model
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

# llmopt's rows: (method, settings besides 4 bits in groups of 32); float zero: a float minimum per group (Q4_1's)
LLMOPT_ROWS = {"gptq": ("gptq", {"sym": True}), "rtn": ("rtn", {"sym": True}),
               "gptq-asym": ("gptq", {"sym": False}), "rtn-asym": ("rtn", {"sym": False}),
               "gptq-fzp": ("gptq", {"sym": False, "zero_point": "float"}),
               "rtn-fzp": ("rtn", {"sym": False, "zero_point": "float"})}
LLAMA_CPP_TYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
                   "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_1-f16emb": "LLAMA_FTYPE_MOSTLY_Q4_1"}
# llama.cpp's quantizer puts the token embedding (tied to the output here) in 8 bits; llmopt's artifacts keep it in
# 16: this row asks llama.cpp for F16 there too (--token-embedding-type f16), the like-for-like control
F16_EMBEDDING_ROWS = {"Q4_1-f16emb"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


class LlamaCppModel:
    """llama.cpp behind the `model(input_ids=...).logits` call llmopt's perplexity makes (one window at a time)."""

    def __init__(self, path: Path, seqlen: int, threads: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(str(path), n_ctx=seqlen, n_batch=seqlen, n_threads=threads, logits_all=True,
                                   verbose=False)

    def parameters(self):
        yield torch.empty(0)

    def __call__(self, input_ids: torch.Tensor, use_cache: bool = False):
        rows = []
        for window in input_ids.tolist():
            self.llm.reset()
            self.llm.eval(window)
            rows.append(torch.from_numpy(np.array(self.llm.scores[: len(window)], dtype=np.float32)))

        class Out:
            logits = torch.stack(rows)

        return Out()

    def greedy(self, prompt: list[int], tokens: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        out = []
        for _ in range(tokens):
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            out.append(token)
            self.llm.eval([token])
        return out


def rotated_copy(model_name: str, rotations: str, out: Path) -> Path:
    """The fp model with `rotations` ("R1" or "R1,R2", as --rotate takes them; the default seed) folded in, saved
    as a Hugging Face folder at `out`."""
    [config] = rotation_config(rotations, None)  # checked as the CLI checks them: an unknown name is an error
    model, tokenizer, _ = load_model(model_name, dtype="float32")
    rotate(model, config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    import llama_cpp

    parser = command_line(__doc__, type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--only", help="these rows only, comma-separated: gptq, rtn, gptq-asym, rtn-asym, gptq-fzp, "
                        "rtn-fzp, Q4_0, Q4_1, Q4_K_M, Q4_1-f16emb, f32")
    parser.add_argument("--rotate", help="rotate the fp model first: R1 or R1,R2 (seed 0)")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    threads = torch.get_num_threads()
    print(cpu_line(), flush=True)
    tokenizer = load_tokenizer(resolve_model(args.model))
    ids = tokenize_corpus(tokenizer, "wikitext2", args.max_tokens)
    rows, facts = [], {}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        if args.rotate:
            args.model = str(rotated_copy(args.model, args.rotate, root / "rotated"))
        artifacts = {}
        for stem, (method, settings) in LLMOPT_ROWS.items():
            if only is not None and stem not in only:
                continue
            out = root / f"{stem}-w4g32"
            quantize_to_artifact(args.model, out, [make_config(method, bits=4, group_size=32, **settings)])
            artifacts[stem] = out
            facts[f"{stem}_export"] = export_gguf(out, root / f"{stem}.gguf")
        facts["f32_export"] = export_gguf(resolve_model(args.model).path, root / "f32.gguf")
        for name, ftype in LLAMA_CPP_TYPES.items():
            if only is not None and name not in only:
                continue
            llamacpp_quantize(root / "f32.gguf", root / f"{name}.gguf", ftype, threads, name in F16_EMBEDDING_ROWS)
        files = {"llmopt GPTQ w4 g32 -> Q4_0": "gptq", "llmopt RTN w4 g32 -> Q4_0": "rtn",
                 "llmopt GPTQ w4 g32 asym -> Q4_1": "gptq-asym", "llmopt RTN w4 g32 asym -> Q4_1": "rtn-asym",
                 "llmopt GPTQ w4 g32 float zero -> Q4_1": "gptq-fzp",
                 "llmopt RTN w4 g32 float zero -> Q4_1": "rtn-fzp", "llama.cpp Q4_0": "Q4_0",
                 "llama.cpp Q4_1": "Q4_1", "llama.cpp Q4_K_M": "Q4_K_M",
                 "llama.cpp Q4_1, embedding F16": "Q4_1-f16emb", "fp32 (F32 GGUF)": "f32"}
        for label, stem in files.items():
            if only is not None and stem not in only:
                continue
            llm = LlamaCppModel(root / f"{stem}.gguf", args.seqlen, threads)
            ppl = perplexity(llm, ids, args.seqlen, batch_size=1).ppl
            row = {"weights": label, "llama_cpp_ppl": ppl, "gguf_mb": (root / f"{stem}.gguf").stat().st_size / 1e6}
            if stem in artifacts:
                row["llmopt_ppl"] = perplexity(load_artifact_model(artifacts[stem]), ids, args.seqlen).ppl
                row["ppl_difference"] = ppl / row["llmopt_ppl"] - 1
            rows.append(row)
            print(row, flush=True)
            if stem == "gptq":
                model, tok, _ = load_runtime_model(str(artifacts["gptq"]))
                engine = Engine(model, tok, EngineConfig())
                prompts = [tok(p)["input_ids"] for p in PROMPTS]
                ours = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))]
                theirs = [llm.greedy(p, 32) for p in prompts]
                facts["greedy_equal"] = [a == b for a, b in zip(ours, theirs)]
                facts["greedy_common_prefix"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                                                 for a, b in zip(ours, theirs)]
                print("greedy equal:", facts["greedy_equal"], facts["greedy_common_prefix"], flush=True)
    print(f"\nwikitext2, {ids.numel():,} tokens in windows of {args.seqlen}; {threads} threads\n")
    print("| weights | GGUF MB | ppl (llama.cpp) | ppl (llmopt) | difference |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        ours = f"{r['llmopt_ppl']:.3f}" if "llmopt_ppl" in r else ""
        diff = f"{r['ppl_difference']:+.2%}" if "ppl_difference" in r else ""
        print(f"| {r['weights']} | {r['gguf_mb']:.1f} | {r['llama_cpp_ppl']:.3f} | {ours} | {diff} |")
    if args.json:
        write_json(args.json, {"cpu": cpu_line(), "max_tokens": args.max_tokens, "seqlen": args.seqlen,
                               "rotate": args.rotate,
                               "rows": rows, **{k: v for k, v in facts.items() if not k.endswith("_export")},
                               "exports": {k: v for k, v in facts.items() if k.endswith("_export")},
                               "llama_cpp_version": getattr(llama_cpp, "__version__", "?"),
                               "nan_free": all(math.isfinite(r["llama_cpp_ppl"]) for r in rows)})


if __name__ == "__main__":
    main()
