"""Multiple-choice evaluation through the server, as a new user runs it: lm-evaluation-harness's own
`local-completions` client (loglikelihood requests: echo + logprobs, max_tokens 1; one request per call) against
`llmopt serve MODEL`, on ARC-Easy's questions (the data dir's ARC file, lm-eval's arc_easy format: "Question:
...\\nAnswer:" + " choice"). Prints the wall time, the accuracy (acc, acc_norm: lm-eval's rules) and the server's
prefix-cache hit rate.

--checkout DIR serves from another checkout of llmopt (an earlier commit, for a before/after in one run: the
same client, data and machine).

    python benchmarks/runtime/serve_scoring.py --limit 200 --json docs/results/data/serve_scoring.json \\
        [--checkout /tmp/llmopt-before]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import httpx

from llmopt.core.hardware import cpu_line
from llmopt.core.models import load_tokenizer, resolve_model
from llmopt.eval.tasks import load_docs, score
from serve import free_port, start_server
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402


def hit_rate(port: int) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["llmopt:prefix_cache_hit_rate"]


def main() -> None:
    parser = command_line(__doc__, type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--checkout", default=None)
    args = parser.parse_args()
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    docs = load_docs("arc_easy", args.limit)
    pairs = [(ctx, cont) for doc in docs for ctx, cont in zip(doc.contexts, doc.continuations)]
    port = free_port()
    server = start_server(args.model, port, checkout=args.checkout, quiet=True)
    try:
        with tempfile.TemporaryDirectory() as folder:
            load_tokenizer(resolve_model(args.model)).save_pretrained(folder)
            lm = LocalCompletionsAPI(model=args.model, base_url=f"http://127.0.0.1:{port}/v1/completions",
                                     tokenizer=folder, tokenizer_backend="huggingface", max_retries=1,
                                     max_length=2048)
            requests = [Instance("loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
            start_time = time.perf_counter()
            results = lm.loglikelihood(requests, disable_tqdm=True)
            wall = time.perf_counter() - start_time
        row = {"cpu": cpu_line(), "checkout": args.checkout or "this", "docs": len(docs), "requests": len(pairs),
               "wall_s": wall, "requests_per_s": len(pairs) / wall, **score(docs, results),
               "prefix_cache_hit_rate": hit_rate(port)}
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(json.dumps(row))
    if args.json:
        rows = json.loads(args.json.read_text()) if args.json.exists() else []
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows + [row], indent=1))


if __name__ == "__main__":
    main()
