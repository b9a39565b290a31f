"""What the row-by-row benchmark scripts share: their common options, and a JSON of rows written after every
row (atomically, so an interrupted run keeps what finished; `--resume` skips rows already there)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmopt.core.io import write_json, write_text


def row_parser(description: str, json_default: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", default=json_default)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--only", default=None, help="semicolon-separated substrings of row names")
    parser.add_argument("--resume", action="store_true")
    return parser


def load_rows(path: str | Path, resume: bool):
    path = Path(path)
    return json.loads(path.read_text()) if resume and path.exists() else []


def save_rows(path: str | Path, rows) -> None:
    write_json(path, rows, indent=1)


def emit(table: str, markdown_path: str | None) -> None:
    print(table)
    if markdown_path:
        write_text(markdown_path, table + "\n")
