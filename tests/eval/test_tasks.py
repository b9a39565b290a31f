"""Task scoring against log-likelihoods computed by hand, and each task's file format."""

import bz2
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from llmopt.eval.tasks import Doc, encode_pair, evaluate_task, load_docs, loglikelihoods, score

V = 128
FAV, OTHER = math.log(9 / (9 + V - 1)), math.log(1 / (9 + V - 1))


class CharTokenizer:
    bos_token_id = 0
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


class NextCharModel(nn.Module):
    """p(next = previous + 1) = 9 / (9 + V - 1); every other token 1 / (9 + V - 1)."""

    def __init__(self):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, V)
        logits.scatter_(-1, ((input_ids + 1) % V).unsqueeze(-1), math.log(9))
        return SimpleNamespace(logits=logits)


def hand_ll(context, continuation):
    text = context + continuation
    start = len(context)
    return sum(FAV if ord(text[i]) == ord(text[i - 1]) + 1 else OTHER for i in range(start, len(text)))


def test_encode_pair_moves_trailing_spaces():
    tok = CharTokenizer()
    assert encode_pair(tok, "ab ", "c") == ([97, 98], [32, 99])
    assert encode_pair(tok, "ab", " c") == ([97, 98], [32, 99])


def test_loglikelihoods_by_hand():
    pairs = [("ab", "cd"), ("xyz", " q"), ("hello", " world, longer one")]
    results = loglikelihoods(NextCharModel(), CharTokenizer(), pairs, batch_size=2)
    for (context, continuation), (ll, greedy) in zip(pairs, results):
        assert ll == pytest.approx(hand_ll(context, continuation), abs=1e-4)
    assert [g for _, g in results] == [True, False, False]  # "ab" -> "cd" follows previous + 1 every time


def test_multiple_choice_acc_and_acc_norm_by_hand():
    # " bcdefgh" after "a" is 1 unlikely space + 7 likely steps; " z" is 2 unlikely tokens.
    doc = Doc(["a", "a"], [" bcdefgh", " z"], gold=0)
    pairs = list(zip(doc.contexts, doc.continuations))
    results = loglikelihoods(NextCharModel(), CharTokenizer(), pairs)
    lls = [hand_ll(c, x) for c, x in pairs]  # -2.99 - ... : compare by hand
    assert (lls[0] > lls[1]) == (results[0][0] > results[1][0])
    metrics = score([doc], results)
    assert metrics["acc"] == (1.0 if lls[0] > lls[1] else 0.0)
    normed = [lls[0] / 7, lls[1] / 1]  # lengths without the " " delimiter
    assert metrics["acc_norm"] == (1.0 if normed[0] > normed[1] else 0.0)
    # a doc where length normalization flips the choice: many unlikely chars vs one
    flip = Doc(["a", "a"], [" zzzz", " q"], gold=0)
    r = loglikelihoods(NextCharModel(), CharTokenizer(), list(zip(flip.contexts, flip.continuations)))
    m = score([flip], r)
    assert m["acc"] == 0.0 and m["acc_norm"] == 1.0  # -5 OTHER /4 > -2 OTHER /1


def test_lambada_and_partial_scoring():
    docs = [Doc(["ab"], ["cd"], 0, "lambada"), Doc(["ab"], ["zz"], 0, "lambada")]
    results = loglikelihoods(NextCharModel(), CharTokenizer(), [("ab", "cd"), ("ab", "zz")])
    m = score(docs, results)
    assert m["acc"] == 0.5
    assert m["ppl"] == pytest.approx(math.exp(-(hand_ll("ab", "cd") + hand_ll("ab", "zz")) / 2), rel=1e-5)
    wino = Doc(["xa", "xq"], ["bc", "bc"], gold=0, kind="partial")  # "a" then "bc" follows previous + 1
    m = score([wino], loglikelihoods(NextCharModel(), CharTokenizer(), list(zip(wino.contexts, wino.continuations))))
    assert m == {"acc": 1.0, "num_docs": 1}


def test_task_files_are_read_in_their_formats(tmp_path, monkeypatch):
    (tmp_path / "arc").mkdir()
    (tmp_path / "arc" / "arc_easy_test.jsonl").write_text(
        json.dumps({"query": "Question: 1+1?", "choices": ["2", "3"], "gold": 0}) + "\n")
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "valid.jsonl").write_text(json.dumps({"goal": "g", "sol1": "a", "sol2": "b"}) + "\n")
    (tmp_path / "piqa" / "valid-labels.lst").write_text("1\n")
    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "hellaswag_val_full.txt.bz2").write_bytes(
        bz2.compress("Label: ctx\n2\ne0\ne1\ne2\ne3\n".encode()))
    (tmp_path / "lambada").mkdir()
    (tmp_path / "lambada" / "lambada_openai_test.jsonl").write_text(json.dumps({"context": "ab", "continuation": "cd"}))
    (tmp_path / "winogrande").mkdir()
    (tmp_path / "winogrande" / "winogrande_dev.jsonl").write_text(
        json.dumps({"context_options": ["A so A", "A so B"], "continuation": "won.", "gold": 1}))
    monkeypatch.setenv("LLMOPT_DATA_DIR", str(tmp_path))
    [arc] = load_docs("arc_easy")
    assert arc.contexts[0] == "Question: 1+1?\nAnswer:" and arc.continuations == [" 2", " 3"] and arc.gold == 0
    [piqa] = load_docs("piqa")
    assert piqa.contexts[0] == "Question: g\nAnswer:" and piqa.gold == 1
    [hs] = load_docs("hellaswag")
    assert hs.contexts[0] == "Label: ctx" and hs.continuations == [" e0", " e1", " e2", " e3"] and hs.gold == 2
    [lam] = load_docs("lambada")
    assert lam.continuations == [" cd"] and lam.kind == "lambada"
    [wg] = load_docs("winogrande")
    assert wg.contexts == ["A so A", "A so B"] and wg.continuations == [" won.", " won."] and wg.gold == 1
    result = evaluate_task(NextCharModel(), CharTokenizer(), "arc_easy")
    assert result["num_docs"] == 1 and set(result) == {"acc", "acc_norm", "num_docs"}
    with pytest.raises(Exception, match="data file not found"):
        load_docs("arc_challenge")


def winogrande_data(folder, count: int) -> None:
    """A data dir holding `count` WinoGrande records (the data dir's format), for CLI runs on tiny models."""
    (folder / "winogrande").mkdir()
    (folder / "winogrande" / "winogrande_dev.jsonl").write_text("\n".join(
        json.dumps({"context_options": [f"A{i} so A", f"A{i} so B"], "continuation": "won.", "gold": i % 2})
        for i in range(count)))


def test_eval_tasks_cli_on_a_tiny_model(tiny_llama_dir, tmp_path, monkeypatch):
    from tests.cli.test_cli import run

    winogrande_data(tmp_path, 3)
    monkeypatch.setenv("LLMOPT_DATA_DIR", str(tmp_path))
    result = run("eval", "tasks", tiny_llama_dir, "--tasks", "winogrande", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["tasks"]["winogrande"]["num_docs"] == 3 and 0 <= out["tasks"]["winogrande"]["acc"] <= 1


def test_span_only_projection_equals_full_logits(tiny_llama_dir):
    """The fast path (decoder, then lm_head on the continuation rows only) scores exactly as full logits."""
    from llmopt.formats.load import load_model

    model, tokenizer, _ = load_model(str(tiny_llama_dir))
    pairs = [("def f(x):", " return x"), ("import", " os"), ("class A:\n   ", " pass  # a longer tail")]
    fast = loglikelihoods(model, tokenizer, pairs, batch_size=2)
    for (context, continuation), (ll, greedy) in zip(pairs, fast):
        ctx, cont = encode_pair(tokenizer, context, continuation)
        ids = torch.tensor([ctx + cont])
        logprobs = torch.log_softmax(model(input_ids=ids[:, :-1]).logits.float(), dim=-1)[0, -len(cont):]
        target = torch.tensor(cont)
        assert ll == pytest.approx(float(logprobs.gather(1, target[:, None]).sum()), abs=1e-4)
        assert greedy == bool((logprobs.argmax(-1) == target).all())
