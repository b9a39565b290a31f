"""Task data is checked as it is read: a damaged record is one line naming file:line, a damaged archive one line,
a labels file that does not match its data (or an invalid gold label) refused instead of scoring fewer documents
(exit 0) or a wrong one."""

import bz2
import json

import pytest

from llmopt.core.errors import DatasetError
from llmopt.eval.tasks import load_docs
from tests.cli.test_cli import assert_one_line_error, run

ARC = {"query": "Which is a fruit?", "choices": ["apple", "stone"], "gold": 0}
PIQA = {"goal": "open a jar", "sol1": "twist the lid", "sol2": "shout at it"}
WINO = {"context_options": ["Ann gave Bo a gift because Ann", "Ann gave Bo a gift because Bo"],
        "continuation": "was kind.", "gold": 1}


def lines(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def hellaswag(*golds) -> bytes:
    text = "".join(f"context {i}\n{g}\n" + "".join(f"ending {j}\n" for j in range(4)) for i, g in enumerate(golds))
    return bz2.compress(text.encode())


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_DATA_DIR", str(tmp_path))
    for folder in ("arc", "piqa", "hellaswag", "winogrande", "lambada"):
        (tmp_path / folder).mkdir()
    return tmp_path


def test_good_files_load(data):
    (data / "arc" / "arc_easy_test.jsonl").write_text(lines(ARC, ARC))
    (data / "piqa" / "valid.jsonl").write_text(lines(PIQA, PIQA))
    (data / "piqa" / "valid-labels.lst").write_text("0\n1\n")
    (data / "hellaswag" / "hellaswag_val_full.txt.bz2").write_bytes(hellaswag(3, 0))
    (data / "winogrande" / "winogrande_dev.jsonl").write_text(lines(WINO))
    assert [d.gold for d in load_docs("arc_easy")] == [0, 0]
    assert [d.gold for d in load_docs("piqa")] == [0, 1]
    assert [d.gold for d in load_docs("hellaswag")] == [3, 0]
    assert [d.gold for d in load_docs("winogrande")] == [1]


@pytest.mark.parametrize("task, files, message", [
    # JSON cut mid-record (it was a traceback)
    ("arc_easy", {"arc/arc_easy_test.jsonl": lines(ARC, json.dumps(ARC)[:25])},
     r"arc_easy_test.jsonl:2: not valid JSON"),
    ("arc_easy", {"arc/arc_easy_test.jsonl": lines(ARC, {**ARC, "gold": 2})}, r"arc_easy_test.jsonl:2: gold label 2 "),
    ("arc_easy", {"arc/arc_easy_test.jsonl": lines({**ARC, "gold": "x"})}, r":1: gold label 'x' is not one of 0..1"),
    ("arc_easy", {"arc/arc_easy_test.jsonl": lines({"query": "q", "gold": 0})}, r":1: field 'choices' must be"),
    ("arc_easy", {"arc/arc_easy_test.jsonl": lines([1, 2])}, r":1: a JSON list, not an object"),
    # a labels file shorter than its data (it scored fewer documents, exit 0), an invalid label (accepted)
    ("piqa", {"piqa/valid.jsonl": lines(PIQA, PIQA, PIQA), "piqa/valid-labels.lst": "0\n1\n"},
     r"valid-labels.lst: 2 labels for the 3 records of valid.jsonl"),
    ("piqa", {"piqa/valid.jsonl": lines(PIQA, PIQA), "piqa/valid-labels.lst": "0\n7\n"},
     r"valid-labels.lst:2: gold label '7' is not one of 0..1"),
    ("piqa", {"piqa/valid.jsonl": lines({**PIQA, "sol2": None}), "piqa/valid-labels.lst": "0\n"},
     r"valid.jsonl:1: field 'sol2' is None, not text"),
    # a .bz2 cut short (a traceback), a gold line out of range
    ("hellaswag", {"hellaswag/hellaswag_val_full.txt.bz2": hellaswag(1, 2)[:-20]}, r"not a complete bz2 archive"),
    ("hellaswag", {"hellaswag/hellaswag_val_full.txt.bz2": hellaswag(1, 4)}, r":8: gold label '4' is not one of 0..3"),
    ("hellaswag", {"hellaswag/hellaswag_val_full.txt.bz2": bz2.compress(b"context\n1\nonly one ending\n")},
     r"3 lines, not a multiple of 6"),
    ("winogrande", {"winogrande/winogrande_dev.jsonl": lines({**WINO, "context_options": ["one"]})},
     r":1: field 'context_options' must be 2 texts"),
    ("lambada", {"lambada/lambada_openai_test.jsonl": lines({"context": "a b"})},
     r":1: field 'continuation' is missing"),
    # an empty task file (an IndexError in the scorer)
    ("arc_easy", {"arc/arc_easy_test.jsonl": ""}, r"arc_easy_test.jsonl holds no documents"),
    ("lambada", {"lambada/lambada_openai_test.jsonl": "\n\n"}, r"lambada_openai_test.jsonl holds no documents"),
])
def test_damaged_task_data_is_one_line_naming_file_and_line(data, task, files, message):
    for name, content in files.items():
        (data / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DatasetError, match=message):
        load_docs(task)
    assert_one_line_error(run("eval", "tasks", "tiny-random-llama", "--tasks", task, "--dtype", "float32"), message)


@pytest.mark.parametrize("backend", ["hf", "runtime"])
def test_documents_beyond_the_context_are_cut_or_named(data, backend):
    """A context longer than the model's (1024 tokens for the tiny model) is cut from the left, as lm-eval cuts it,
    on either backend (the runtime refused it, naming no document); a continuation that alone exceeds it is
    refused naming its file:line."""
    long_context = {"context": "word " * 3000, "continuation": "end"}
    (data / "lambada" / "lambada_openai_test.jsonl").write_text(lines(long_context, long_context))
    result = run("eval", "tasks", "tiny-random-llama", "--tasks", "lambada", "--dtype", "float32", "--backend",
                 backend, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tasks"]["lambada"]["num_docs"] == 2
    (data / "lambada" / "lambada_openai_test.jsonl").write_text(lines({"context": "a", "continuation": "x " * 3000}))
    assert_one_line_error(run("eval", "tasks", "tiny-random-llama", "--tasks", "lambada", "--dtype", "float32",
                              "--backend", backend), r"lambada_openai_test.jsonl:1: its continuation is \d+ tokens")
