"""Terminal output: figures go to stdout (one JSON object with --json), everything else to stderr."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

stderr = Console(stderr=True)
stdout = Console()


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()


def print_table(title: str, rows: dict[str, Any] | list[dict[str, Any]]) -> None:
    """A key/value table (dict) or a row table (list of dicts with the same keys), on stdout."""
    table = Table(title=title)
    if isinstance(rows, dict):
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in rows.items():
            table.add_row(key, format_value(value))
    else:
        for key in rows[0]:
            table.add_column(key, justify="right" if not isinstance(rows[0][key], str) else "left")
        for row in rows:
            table.add_row(*(format_value(v) for v in row.values()))
    stdout.print(table)


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


@contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None]]:
    """Yields update(done, total); the bar draws on stderr so --json output stays clean."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    # no bar when stderr is not a terminal (a log, a pipe): it would leave only a blank line there
    with Progress(*columns, console=stderr, transient=True, disable=not stderr.is_terminal) as progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update
