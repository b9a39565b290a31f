"""Zero-shot task accuracy scored as lm-evaluation-harness scores it: the log-likelihood of each candidate
continuation after its context.

- multiple choice (ARC, PIQA, HellaSwag): acc = argmax of summed log-likelihood; acc_norm = argmax of
  log-likelihood divided by the candidate's length in characters (lm-eval's `acc_norm`);
- WinoGrande (partial scoring): each option fills the sentence up to the blank; both score the same
  continuation, so only acc;
- LAMBADA: acc = the last word is the greedy continuation (every token the argmax), ppl = exp(-mean loglik).

Continuations are scored as " " + text after the context (lm-eval's target delimiter); context and continuation
are tokenized together and split where the context's tokens end, as lm-eval's `_encode_pair` does.
Data come from the data dir (formats in shared/data/README.md).
"""

from __future__ import annotations

import bz2
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from llmopt.core.errors import DatasetError
from llmopt.core.paths import data_dir, data_dir_candidates
from llmopt.core.registry import Registry


@dataclass
class Doc:
    contexts: list[str]  # one per candidate (WinoGrande) or the same context repeated
    continuations: list[str]  # one per candidate, scored after its context
    gold: int
    kind: str = "choice"  # "choice" | "partial" | "lambada"
    where: str = ""  # file:line of its record (what messages about it name)


@dataclass(frozen=True)
class Task:
    name: str
    data_file: str
    load: Callable[[Path], list[Doc]]


TASKS: Registry[Task] = Registry("task")
MAX_LENGTH = 2048  # tokens of a scored pair at most (lm-eval's default max_length), fewer where the context is shorter


# --- readers: each record checked, the first bad one reported as file:line ------------------------------
def _bad(path: Path, line: int | None, what: str) -> DatasetError:
    where = f"{path}:{line}" if line else str(path)
    return DatasetError(f"{where}: {what}: the task file is damaged; restore it (see the data folder's README)")


def _jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line, each a JSON object."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _bad(path, None, f"not UTF-8 text (byte {e.start})") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise _bad(path, number, f"not valid JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(record, dict):
            raise _bad(path, number, f"a JSON {type(record).__name__}, not an object")
        records.append((number, record))
    return records


def _text(path: Path, number: int, record: dict, name: str) -> str:
    value = record.get(name)
    if not isinstance(value, str):
        raise _bad(path, number, f"field {name!r} is {'missing' if name not in record else repr(value)[:40]}, "
                                 f"not text")
    return value


def _texts(path: Path, number: int, record: dict, name: str, count: int | None = None) -> list[str]:
    value = record.get(name)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value) or \
            (count is not None and len(value) != count):
        size = f"{count} " if count else "a non-empty list of "
        raise _bad(path, number, f"field {name!r} must be {size}texts (got {repr(value)[:60]})")
    return value


def _gold(path: Path, number: int, value, choices: int) -> int:
    """A label in 0..choices-1 (an int, or a string of one, as the label files hold)."""
    try:
        gold = int(value)
    except (TypeError, ValueError):
        gold = None
    if gold is None or isinstance(value, bool) or str(gold) != str(value).strip() or not 0 <= gold < choices:
        raise _bad(path, number, f"gold label {value!r} is not one of 0..{choices - 1}")
    return gold


def _arc(path: Path) -> list[Doc]:
    docs = []
    for number, r in _jsonl(path):
        choices = _texts(path, number, r, "choices")
        query = _text(path, number, r, "query")
        docs.append(Doc([query + "\nAnswer:"] * len(choices), [" " + c for c in choices],
                        _gold(path, number, r.get("gold"), len(choices)), where=f"{path}:{number}"))
    return docs


def _piqa(path: Path) -> list[Doc]:
    labels_file = path.with_name("valid-labels.lst")
    if not labels_file.is_file():
        raise _bad(labels_file, None, "the labels file is missing")
    labels = labels_file.read_text().splitlines()
    records = _jsonl(path)
    if len(labels) != len(records):
        raise _bad(labels_file, None, f"{len(labels)} labels for the {len(records)} records of {path.name}")
    docs = []
    for i, ((number, r), label) in enumerate(zip(records, labels)):
        goal, sol1, sol2 = (_text(path, number, r, k) for k in ("goal", "sol1", "sol2"))
        docs.append(Doc(["Question: " + goal + "\nAnswer:"] * 2, [" " + sol1, " " + sol2],
                        _gold(labels_file, i + 1, label, 2), where=f"{path}:{number}"))
    return docs


HELLASWAG_LINES = 6  # context, gold label, 4 endings


def _hellaswag(path: Path) -> list[Doc]:
    try:
        lines = bz2.decompress(path.read_bytes()).decode("utf-8").splitlines()
    except (OSError, EOFError, ValueError) as e:  # a cut or corrupt archive; bad UTF-8 inside
        raise _bad(path, None, f"not a complete bz2 archive of UTF-8 text ({e})") from None
    if not lines or len(lines) % HELLASWAG_LINES:
        raise _bad(path, None, f"{len(lines)} lines, not a multiple of {HELLASWAG_LINES} (cut short?)")
    docs = []
    for i in range(0, len(lines), HELLASWAG_LINES):
        context, endings = lines[i], lines[i + 2:i + HELLASWAG_LINES]
        docs.append(Doc([context] * 4, [" " + e for e in endings], _gold(path, i + 2, lines[i + 1], 4),
                        where=f"{path}:{i + 1}"))
    return docs


def _lambada(path: Path) -> list[Doc]:
    return [Doc([_text(path, n, r, "context")], [" " + _text(path, n, r, "continuation")], 0, "lambada",
                f"{path}:{n}") for n, r in _jsonl(path)]


def _winogrande(path: Path) -> list[Doc]:
    return [Doc(_texts(path, n, r, "context_options", 2), [" " + _text(path, n, r, "continuation")] * 2,
                _gold(path, n, r.get("gold"), 2), "partial", f"{path}:{n}") for n, r in _jsonl(path)]


for _task in (Task("arc_easy", "arc/arc_easy_test.jsonl", _arc),
              Task("arc_challenge", "arc/arc_challenge_test.jsonl", _arc),
              Task("piqa", "piqa/valid.jsonl", _piqa),
              Task("hellaswag", "hellaswag/hellaswag_val_full.txt.bz2", _hellaswag),
              Task("lambada", "lambada/lambada_openai_test.jsonl", _lambada),
              Task("winogrande", "winogrande/winogrande_dev.jsonl", _winogrande)):
    TASKS.add(_task.name, _task)


def load_docs(name: str, limit: int | None = None) -> list[Doc]:
    task = TASKS.get(name)
    root = data_dir()
    if root is None or not (root / task.data_file).is_file():
        looked = ", ".join(str(p / task.data_file) for p in data_dir_candidates())
        raise DatasetError(f"task {name!r}: data file not found (looked in {looked}); set LLMOPT_DATA_DIR")
    docs = task.load(root / task.data_file)
    if not docs:
        raise DatasetError(f"task {name!r}: {root / task.data_file} holds no documents: the task file is damaged; "
                           f"restore it (see the data folder's README)")
    return docs[:limit] if limit else docs


# --- log-likelihoods ---------------------------------------------------------------------------------
def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing spaces move from the context to the continuation; the pair is tokenized
    whole and cut where the context's own tokens end."""
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    return whole[:len(context_ids)], whole[len(context_ids):]


@torch.inference_mode()
def encode_pairs(tokenizer, pairs: list[tuple[str, str]], max_length: int = MAX_LENGTH,
                 origins: list[str] | None = None) -> list[tuple[list[int], int]]:
    """(token ids of context + continuation, at most max_length + 1 of them, keeping the end: a long context is cut
    from the left, as lm-eval cuts it; the continuation's length) per pair; an empty context becomes the BOS (or
    EOS) token, as lm-eval does. A continuation that alone exceeds max_length is refused, naming its document
    (`origins`: each pair's file:line)."""
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    encoded = []
    for i, (context, continuation) in enumerate(pairs):
        ctx, cont = encode_pair(tokenizer, context, continuation)
        where = f"{origins[i]}: " if origins and origins[i] else ""
        if not cont:
            raise DatasetError(f"{where}empty continuation after tokenizing {continuation!r}")
        if len(cont) > max_length:
            raise DatasetError(f"{where}its continuation is {len(cont)} tokens, more than the {max_length} the "
                               f"model's context leaves for scoring: shorten it or leave that document out")
        ids = (ctx or [prefix]) + cont
        encoded.append((ids[-(max_length + 1):], len(cont)))
    return encoded


def scoring_length(context: int | None, reserved: int) -> int:
    """The tokens a scored pair may hold (encode_pairs' max_length): MAX_LENGTH, or fewer where the model's context
    minus `reserved` (what the scorer adds to the pair) is shorter."""
    return MAX_LENGTH if not context else max(1, min(MAX_LENGTH, context - reserved))


def loglikelihoods(model, tokenizer, pairs: list[tuple[str, str]], batch_size: int = 16,
                   max_length: int | None = None, progress: Callable[[int, int], None] | None = None,
                   origins: list[str] | None = None) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether every continuation token is the argmax) per pair; pairs cut
    to the model's context (max_length None: scoring_length of its max_position_embeddings)."""
    device = next(model.parameters()).device
    if max_length is None:
        max_length = scoring_length(getattr(getattr(model, "config", None), "max_position_embeddings", None), 0)
    encoded = encode_pairs(tokenizer, pairs, max_length, origins)
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))  # similar lengths batch together
    results: list[tuple[float, bool] | None] = [None] * len(encoded)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        width = max(len(encoded[i][0]) for i in batch) - 1
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids = encoded[i][0][:-1]
            input_ids[row, :len(ids)] = torch.tensor(ids)  # right padding: positions stay those of the text
        spans = [slice(len(encoded[i][0]) - 1 - encoded[i][1], len(encoded[i][0]) - 1) for i in batch]
        span_logits = _span_logits(model, input_ids.to(device), spans)  # one [num_cont, V] per row
        for row, i in enumerate(batch):
            ids, num_cont = encoded[i]
            logprobs = F.log_softmax(span_logits[row].float(), dim=-1).cpu()
            target = torch.tensor(ids[-num_cont:])
            token_logprobs = logprobs.gather(1, target[:, None])[:, 0]
            greedy = bool((logprobs.argmax(dim=-1) == target).all())
            results[i] = (float(token_logprobs.sum()), greedy)
        if progress:
            progress(min(start + batch_size, len(order)), len(order))
    return results


def _span_logits(model, input_ids: torch.Tensor, spans: list[slice]) -> list[torch.Tensor]:
    """Logits at the continuation positions only. The vocabulary projection of every position ([B, T, V],
    V = 49k for SmolLM2) costs more than the decoder on these short texts, so when the model is a plain
    decoder + lm_head, project just the span rows; otherwise take the full logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plain = (head is not None and getattr(model, "base_model", model) is not model
             and not any(getattr(model.config, a, None) for a in ("final_logit_softcapping", "logit_scale")))
    if not plain:
        logits = model(input_ids=input_ids).logits
        return [logits[row, span] for row, span in enumerate(spans)]
    hidden = model.base_model(input_ids=input_ids).last_hidden_state  # [B, T, H]
    rows = torch.cat([hidden[row, span] for row, span in enumerate(spans)])  # [sum num_cont, H]
    return list(head(rows).split([span.stop - span.start for span in spans]))


def score(docs: list[Doc], results: list[tuple[float, bool]]) -> dict:
    """Accuracy metrics from the per-candidate results, in the order the docs listed their candidates."""
    acc = acc_norm = 0
    lambada_logprob, lambada_tokens_docs = 0.0, 0
    at = 0
    kind = docs[0].kind
    for doc in docs:
        n = len(doc.continuations)
        chunk = results[at:at + n]
        at += n
        if doc.kind == "lambada":
            acc += chunk[0][1]
            lambada_logprob += chunk[0][0]
            lambada_tokens_docs += 1
            continue
        lls = [ll for ll, _ in chunk]
        acc += int(max(range(n), key=lambda j: lls[j]) == doc.gold)
        # lm-eval divides by the candidate's own length, without the " " delimiter
        normed = [ll / max(1, len(c) - c.startswith(" ")) for ll, c in zip(lls, doc.continuations)]
        acc_norm += int(max(range(n), key=lambda j: normed[j]) == doc.gold)
    metrics = {"acc": acc / len(docs), "num_docs": len(docs)}
    if kind == "choice":
        metrics["acc_norm"] = acc_norm / len(docs)
    if kind == "lambada":
        metrics["ppl"] = math.exp(-lambada_logprob / lambada_tokens_docs)
    return metrics


def task_pairs(name: str, limit: int | None = None) -> tuple[list[Doc], list[tuple[str, str]]]:
    """The task's documents and the (context, continuation) pairs to score, in the order `score` reads them."""
    docs = load_docs(name, limit)
    return docs, [(ctx, cont) for doc in docs for ctx, cont in zip(doc.contexts, doc.continuations)]


def pair_origins(docs: list[Doc]) -> list[str]:
    """Each pair's document (file:line), in task_pairs' order."""
    return [doc.where for doc in docs for _ in doc.continuations]


def evaluate_task(model, tokenizer, name: str, limit: int | None = None, batch_size: int = 16,
                  progress: Callable[[int, int], None] | None = None) -> dict:
    docs, pairs = task_pairs(name, limit)
    return score(docs, loglikelihoods(model, tokenizer, pairs, batch_size, progress=progress,
                                      origins=pair_origins(docs)))
