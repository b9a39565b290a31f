"""Text corpora for calibration and evaluation, returned as token tensors, deterministic given a seed.

Each corpus is an ordered list of documents. The `eval` split reads documents from the start; the
`calib` split reads them from the end, so calibration and evaluation on the same corpus stay disjoint
as long as together they take less than the whole corpus (true for every built-in one at the sizes
used here). Named corpora come from the data dir (`$LLMOPT_DATA_DIR`, laid out like shared/data) and
otherwise from the Hugging Face hub through `datasets`.
"""

from __future__ import annotations

import bz2
import json
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import torch

from llmopt.core.errors import DatasetError
from llmopt.core.paths import data_dir, data_dir_candidates
from llmopt.core.registry import Registry

DOC_SEPARATOR = "\n\n"
SPLITS = ("eval", "calib")


@dataclass(frozen=True)
class Corpus:
    name: str
    description: str
    data_file: str | None  # path inside the data dir, if the corpus can come from there
    read_local: Callable[[Path], list[str]] | None  # data-dir file -> documents
    read_hub: Callable[[], list[str]] | None  # -> documents, through `datasets`


CORPORA: Registry[Corpus] = Registry("dataset")


def _read_jsonl_field(path: Path, field: str = "text") -> list[str]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise DatasetError(f"{path}:{line_number} is not valid JSON: fix or remove that line") from None
            docs.append(_record_text(record, field, f"{path}:{line_number}"))
    return docs


def _record_text(record, field: str, where: str) -> str:
    """The text of one JSON record; anything but a string there (null, a number, a list) is refused, not
    scored as its printed form ("None")."""
    if not isinstance(record, dict):
        raise DatasetError(f"{where} is a JSON {type(record).__name__}, not an object with a {field!r} field")
    if field not in record:
        raise DatasetError(f"{where} has no field {field!r} (fields: {', '.join(record)}): pass --text-field")
    text = record[field]
    if not isinstance(text, str):
        shown = "null" if text is None else type(text).__name__
        raise DatasetError(f"{where}: field {field!r} is {shown}, not text: fix or remove that record")
    return text


def _read_json_records(path: Path, field: str = "text") -> list[str]:
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path} is not valid JSON ({e.msg}, line {e.lineno})") from None
    if isinstance(records, dict):
        records = records.get("data") or records.get("rows") or [records]
    docs = []
    if not isinstance(records, list):
        raise DatasetError(f"{path} holds a JSON {type(records).__name__}: give a list of records or strings")
    for number, record in enumerate(records, 1):
        if isinstance(record, str):
            docs.append(record)
        elif isinstance(record, dict) and "conversations" in record and field not in record:  # ShareGPT
            turns = [t for t in record["conversations"] if t.get("from") in ("human", "user")]
            if turns:
                docs.append(turns[0]["value"])
        else:
            docs.append(_record_text(record, field, f"{path} record {number}"))
    return docs


@lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, tuple[Path, ...]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # installed packages are not the standard library; pruned, not walked and filtered (a base interpreter's
        # site-packages can hold ~700 MB: walking it took 1.3 s of a 1.4 s listing)
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        files.extend(Path(folder) / name for name in names if name.endswith(".py"))
    return root, tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


class _LazyStdlibDocs:
    """The stdlib's *.py files as documents, read only when indexed (the whole set is ~40 MB)."""

    def __init__(self):
        self.root, self.files = _stdlib_files()

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> str:
        return self.files[i].read_text(encoding="utf-8", errors="replace")


def _hub(path: str, config: str | None, split: str, field: str) -> Callable[[], list[str]]:
    def read() -> list[str]:
        import datasets

        ds = datasets.load_dataset(path, config, split=split)
        return [str(t) for t in ds[field]]

    return read


CORPORA.add("pystdlib", Corpus(
    "pystdlib", "the Python standard library's *.py files, sorted by relative path (on every machine)",
    None, None, None,
))
CORPORA.add("wikitext2", Corpus(
    "wikitext2", "WikiText-2 raw, test split (HF rows joined with newlines)",
    "wikitext-2-raw/wiki.test.hf-rows-newline-joined.txt",
    lambda p: [p.read_text(encoding="utf-8")],
    lambda: ["\n".join(_hub("Salesforce/wikitext", "wikitext-2-raw-v1", "test", "text")())],
))
CORPORA.add("c4", Corpus(
    "c4", "C4 en, the first 1,000 training documents",
    "c4/c4_en_train_first1000.jsonl",
    _read_jsonl_field,
    _hub("allenai/c4", "en", "validation[:1000]", "text"),
))
CORPORA.add("sharegpt", Corpus(
    "sharegpt", "1,000 ShareGPT first-turn user prompts",
    "sharegpt/ShareGPT_V3_filtered_1000.json",
    _read_json_records,
    None,
))


FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".bz2")


def check_dataset_name(name: str) -> None:
    """Fail now (not after the model has loaded) on a dataset that is neither a corpus nor an existing file."""
    path = Path(name).expanduser()
    if path.is_symlink() and not path.exists():
        raise DatasetError(f"dataset {path} is a symbolic link to nothing (or a loop): fix or remove the link")
    if path.suffix in FILE_SUFFIXES:
        if not path.is_file():
            raise DatasetError(f"dataset file {path} does not exist")
    elif name not in CORPORA:
        raise DatasetError(
            f"unknown dataset {name!r}: use one of {', '.join(CORPORA.names())} or a .txt/.jsonl/.json file"
        )


def documents(name: str, text_field: str = "text"):
    """The documents of a named corpus or a local .txt/.jsonl/.json file, in corpus order."""
    check_dataset_name(name)
    path = Path(name).expanduser()
    if path.suffix not in FILE_SUFFIXES:
        return _corpus_documents(name)
    try:
        if path.suffix == ".jsonl":
            return _read_jsonl_field(path, text_field)
        if path.suffix == ".json":
            return _read_json_records(path, text_field)
        data = bz2.decompress(path.read_bytes()) if path.suffix == ".bz2" else path.read_bytes()
        return [_checked_text(data.decode("utf-8"), path)]
    except UnicodeDecodeError as e:  # bytes that are not text are never scored as replacement characters
        raise DatasetError(f"{path} is not a UTF-8 text file (byte {e.start} is {e.object[e.start]:#04x}): give a "
                           f"text file") from None


def _checked_text(text: str, path: Path) -> str:
    """A file's text, refused when it holds NUL characters (a binary file that happens to decode as UTF-8)."""
    nul = text.find("\x00")
    if nul >= 0:
        raise DatasetError(f"{path} holds a NUL character (at character {nul}): it is binary, not text; give a text "
                           f"file")
    return text


@lru_cache(maxsize=8)
def _corpus_documents(name: str):
    corpus = CORPORA.get(name)
    if name == "pystdlib":
        return _LazyStdlibDocs()
    root = data_dir()
    if root is not None and (root / corpus.data_file).is_file():
        return corpus.read_local(root / corpus.data_file)
    looked = ", ".join(str(p / corpus.data_file) for p in data_dir_candidates())
    if corpus.read_hub is None:
        raise DatasetError(f"dataset {name!r} not found: looked in {looked}; set LLMOPT_DATA_DIR to the data folder")
    try:
        return corpus.read_hub()
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DatasetError(
            f"dataset {name!r} not found: looked in {looked} (set LLMOPT_DATA_DIR) and on the hub ({first})"
        ) from e


def _iter_text(docs, split: str) -> Iterator[str]:
    """Documents joined by DOC_SEPARATOR, from the start (eval) or the end (calib)."""
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    order = range(len(docs)) if split == "eval" else range(len(docs) - 1, -1, -1)
    for n, i in enumerate(order):
        doc = docs[i]
        if split == "calib" and len(docs) == 1:
            # One long text (WikiText): read its second half, so it never overlaps an eval prefix.
            doc = doc[len(doc) // 2:]
        yield (DOC_SEPARATOR if n else "") + doc


def load_text(name: str, split: str = "eval", max_chars: int | None = None, text_field: str = "text") -> str:
    """Text of a corpus, up to `max_chars` characters (whole documents, the last one cut)."""
    docs = documents(name, text_field)
    parts, size = [], 0
    for piece in _iter_text(docs, split):
        parts.append(piece)
        size += len(piece)
        if max_chars is not None and size >= max_chars:
            break
    text = "".join(parts)
    return text if max_chars is None else text[:max_chars]


def tokenize_corpus(
    tokenizer, name: str, max_tokens: int | None, split: str = "eval", text_field: str = "text",
    max_chars: int | None = None,
) -> torch.Tensor:
    """Token ids [num_tokens] of a corpus, tokenized once without special tokens, truncated to max_tokens, from at
    most `max_chars` characters of text.

    Only as much text as needed is read: a character budget that grows until it yields enough tokens
    (BPE pre-tokenization is local, so the kept tokens equal those of the whole text).
    """
    budget = max_chars if max_tokens is None else max(4096, max_tokens * 6)
    while True:
        if max_chars is not None:
            budget = min(budget, max_chars)
        text = load_text(name, split, budget, text_field)
        if not text.strip():
            raise DatasetError(f"dataset {name!r} is empty")
        ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        exhausted = budget is None or len(text) < budget or budget == max_chars
        if max_tokens is None or len(ids) > max_tokens or exhausted:
            break
        budget *= 2
    ids = ids if max_tokens is None else ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)


def calibration_samples(
    tokenizer, datasets: str | list[str], num_samples: int, seqlen: int, seed: int = 0, text_field: str = "text"
) -> torch.Tensor:
    """[num_samples, seqlen] token windows from the calib split; a comma list mixes corpora evenly.

    Windows are non-overlapping, drawn at random (seeded) from twice as many tokens as needed.
    """
    names = [d.strip() for d in (datasets.split(",") if isinstance(datasets, str) else datasets) if d.strip()]
    if not names:
        raise DatasetError("no calibration dataset given: pass --calib NAME[,NAME...]")
    if num_samples < 1 or seqlen < 2:
        raise DatasetError(f"need at least 1 calibration sample of 2+ tokens (got {num_samples} x {seqlen})")
    generator = torch.Generator().manual_seed(seed)
    counts = [num_samples // len(names) + (i < num_samples % len(names)) for i in range(len(names))]
    samples = []
    for name, count in zip(names, counts):
        if count == 0:
            continue
        ids = tokenize_corpus(tokenizer, name, 2 * count * seqlen, "calib", text_field)
        num_windows = ids.numel() // seqlen
        if num_windows < count:
            raise DatasetError(
                f"calibration dataset {name!r} has only {ids.numel()} tokens, fewer than {count} x {seqlen}: "
                "lower --num-samples or --seqlen, or use a larger dataset"
            )
        windows = ids[: num_windows * seqlen].view(num_windows, seqlen)
        pick = torch.randperm(num_windows, generator=generator)[:count]
        samples.append(windows[pick.sort().values])
    return torch.cat(samples)
