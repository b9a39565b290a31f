import json

import pytest
import torch

from llmopt.core import datasets as ds
from llmopt.core.errors import DatasetError
from llmopt.core.tiny import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_pystdlib_is_the_sorted_stdlib_without_site_packages():
    root, files = ds._stdlib_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 500
    assert not any("site-packages" in r for r in rel)
    # the pruned walk lists what every *.py under the root outside installed packages is (the documented set)
    reference = [p for p in root.rglob("*.py") if p.is_file()
                 and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    assert rel == sorted(p.relative_to(root).as_posix() for p in reference)
    text = ds.load_text("pystdlib", max_chars=10_000)
    assert len(text) == 10_000 and text.startswith(files[0].read_text(encoding="utf-8", errors="replace")[:100])


def test_tokenize_corpus_is_a_prefix_of_tokenizing_everything(tok):
    text = ds.load_text("pystdlib", max_chars=50_000)
    full = tok(text, add_special_tokens=False)["input_ids"]
    ids = ds.tokenize_corpus(tok, "pystdlib", 3000)
    assert ids.tolist() == full[:3000]


def test_eval_and_calib_splits_are_disjoint_ends(tmp_path, tok):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc{i}"}) + "\n" for i in range(10)))
    assert ds.load_text(str(path), "eval").startswith("doc0\n\ndoc1")
    assert ds.load_text(str(path), "calib").startswith("doc9\n\ndoc8")
    single = tmp_path / "one.txt"
    single.write_text("A" * 100 + "B" * 100)
    assert ds.load_text(str(single), "calib") == "B" * 100


def test_calibration_samples_are_deterministic_and_mix_evenly(tmp_path, tok):
    a = ds.calibration_samples(tok, "pystdlib", 6, 32, seed=3)
    b = ds.calibration_samples(tok, "pystdlib", 6, 32, seed=3)
    c = ds.calibration_samples(tok, "pystdlib", 6, 32, seed=4)
    assert a.shape == (6, 32) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    other = tmp_path / "other.txt"
    other.write_text("zzzz " * 2000)
    mixed = ds.calibration_samples(tok, f"pystdlib,{other}", 5, 16, seed=0)
    z = tok("z", add_special_tokens=False)["input_ids"][0]
    from_other = [(row == z).any().item() and (row == z).sum() > 5 for row in mixed]
    assert sum(from_other) == 2  # 5 samples over 2 sources: 3 + 2


def test_too_few_calibration_tokens_is_a_clear_error(tmp_path, tok):
    small = tmp_path / "small.txt"
    small.write_text("tiny text")
    with pytest.raises(DatasetError, match="fewer than 4 x 64.*--num-samples"):
        ds.calibration_samples(tok, str(small), 4, 64)


def test_local_file_formats(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"body": "hello"}) + "\n" + json.dumps({"body": "world"}) + "\n")
    assert ds.load_text(str(jsonl), text_field="body") == "hello\n\nworld"
    with pytest.raises(DatasetError, match="no field 'text'.*--text-field"):
        ds.load_text(str(jsonl))
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "hi there"}]}]))
    assert ds.documents(str(sharegpt)) == ["hi there"]


def test_unknown_and_missing_datasets(tmp_path, monkeypatch):
    with pytest.raises(DatasetError, match="unknown dataset 'nope'.*c4.*pystdlib.*wikitext2"):
        ds.documents("nope")
    with pytest.raises(DatasetError, match="does not exist"):
        ds.documents(str(tmp_path / "missing.txt"))
    # No data dir and no hub: the message names both places.
    monkeypatch.setattr(ds, "data_dir", lambda: None)
    monkeypatch.setattr(ds, "data_dir_candidates", lambda: [tmp_path / "nodata"])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ds._corpus_documents.cache_clear()
    try:
        with pytest.raises(DatasetError, match=r"not found: looked in .*nodata.*LLMOPT_DATA_DIR.*hub"):
            ds.documents("wikitext2")
    finally:
        ds._corpus_documents.cache_clear()


@pytest.mark.skipif(ds.data_dir() is None, reason="needs the shared data dir")
def test_data_dir_corpora_read_as_documented():
    wiki = ds.load_text("wikitext2", max_chars=200)
    assert wiki.startswith("\n = Robert Boulter = \n")
    assert ds.documents("c4")[0].startswith("Beginners BBQ Class Taking Place in Missoula!")
    assert len(ds.documents("c4")) == 1000 and len(ds.documents("sharegpt")) == 1000
