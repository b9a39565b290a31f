"""A quick study of GPTQ settings on SmolLM2-135M: quantize in memory (no artifact) with the settings given
as JSON, then perplexity on 8,192 tokens of wikitext2 and pystdlib. `{}` is the fp32 model; a "model" key
picks another starting MODEL (e.g. a pruned artifact) than smollm2-135m.

    python benchmarks/studies/gptq_settings.py '{}' '{"method": "rtn", "bits": 4, "group_size": 64}' \
        '{"method": "gptq", "bits": 4, "group_size": 64, "act_order": false, "mse": false, "damp": 0.01}'
"""

from __future__ import annotations

import copy
import json
import sys
import time


def main() -> None:
    from llmopt.compress.api import make_config, quantize_model
    from llmopt.core.hardware import cpu_line
    from llmopt.core.datasets import tokenize_corpus
    from llmopt.formats.load import load_model
    from llmopt.eval.perplexity import perplexity

    bases = {}
    _, tokenizer, _ = load_model("smollm2-135m")
    evals = {d: tokenize_corpus(tokenizer, d, 8192) for d in ("wikitext2", "pystdlib")}
    results = []
    for spec in sys.argv[1:]:
        settings = json.loads(spec)
        name = settings.pop("model", "smollm2-135m")
        if name not in bases:
            bases[name] = load_model(name)[0]
        model = copy.deepcopy(bases[name])
        start = time.perf_counter()
        if settings:
            method = settings.pop("method")
            quantize_model(model, tokenizer, make_config(method, **settings))
        wall = time.perf_counter() - start
        ppl = {d: round(perplexity(model, ids, 512, 4).ppl, 4) for d, ids in evals.items()}
        results.append({"settings": json.loads(spec), "ppl": ppl, "quantize_s": round(wall, 1), "cpu": cpu_line()})
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
