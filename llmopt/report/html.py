"""A self-contained HTML report (plots embedded as PNG data URIs) and its Markdown twin."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from llmopt.report.tables import _get, fmt_cell, markdown, provenance, rows


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated (higher x is better, lower y is better)."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 >= x and y2 <= y) and (x2 > x or y2 < y) for j, (x2, y2) in enumerate(points) if j != i):
            front.append(i)
    return front


def plots(runs: list[dict]) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [(run["recipe"], v) for run in runs for v in run["variants"]]
    dataset = next((d for _, v in variants for d in (v.get("ppl") or {})), None)
    images = []
    if dataset:
        pts = [(_get(v, ("bench", "metrics", "output_throughput")), v["ppl"].get(dataset), v["name"])
               for _, v in variants if v.get("ppl")]
        pts = [p for p in pts if p[0] is not None and p[1] is not None]
        if pts:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.scatter([p[0] for p in pts], [p[1] for p in pts])
            for x, y, name in pts:
                ax.annotate(name, (x, y), fontsize=8)
            front = sorted((pts[i] for i in pareto_front([(p[0], p[1]) for p in pts])), key=lambda p: p[0])
            if len(front) > 1:  # a trade-off: the front is a line, and the legend names it
                ax.plot([p[0] for p in front], [p[1] for p in front], "r--", label="Pareto front")
                ax.legend()
            elif len(pts) > 1:  # one variant is best on both axes: no trade-off to draw
                ax.set_title(f"{front[0][2]} is best on both axes (no trade-off)", fontsize=9)
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel(f"ppl {dataset} (lower is better)")
            images.append(("Accuracy vs throughput", _png(fig)))
            plt.close(fig)
        sizes = [(v.get("size_mb"), v["ppl"].get(dataset), v["name"]) for _, v in variants if v.get("ppl")]
        sizes = [s for s in sizes if s[0] and s[1] is not None]
        if sizes:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.scatter([s[0] for s in sizes], [s[1] for s in sizes])
            for x, y, name in sizes:
                ax.annotate(name, (x, y), fontsize=8)
            ax.set_xlabel("size MB")
            ax.set_ylabel(f"ppl {dataset}")
            images.append(("Size vs perplexity", _png(fig)))
            plt.close(fig)
    timed = [(v["name"], v["bench"]) for _, v in variants if v.get("bench") and v["bench"].get("ttft_ms")]
    if timed:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, key, title in ((axes[0], "ttft_ms", "TTFT ms"), (axes[1], "tpot_ms", "TPOT ms")):
            samples = [b.get(key) or [] for _, b in timed]
            latency_panel(ax, samples, [n for n, _ in timed])
            ax.set_title(f"{title}: each request (n = {', '.join(str(len(s)) for s in samples)})", fontsize=9)
        images.append(("Latency per request (the bench's requests, each a dot; boxes: quartiles)", _png(fig)))
        plt.close(fig)
    return images


def latency_panel(ax, samples: list[list[float]], names: list[str]) -> None:
    """Every request's latency as a dot (spread sideways so equal ones stay visible) over its variant's box:
    a box alone collapses to a line when a burst's requests share their steps and finish alike."""
    import random

    jitter = random.Random(0)
    filled = [s for s in samples if s]
    if filled:
        ax.boxplot([s or [float("nan")] for s in samples], tick_labels=names, widths=0.5, showfliers=False)
    for i, values in enumerate(samples, 1):
        ax.scatter([i + jitter.uniform(-0.15, 0.15) for _ in values], values, s=10, alpha=0.6, zorder=3)
    ax.set_xticks(range(1, len(names) + 1), names)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)


def html_report(runs: list[dict]) -> str:
    header, body = rows(runs)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c if isinstance(c, str) else fmt_cell(c))}</td>" for c in row)
                  + "</tr>" for row in body)
    figures = "".join(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='{src}'>"
                      for title, src in plots(runs))
    title = "llmopt report: " + ", ".join(sorted({run["recipe"] for run in runs}))
    where = "".join(
        f"<h2>What ran where: {html.escape(run['recipe'])} ({html.escape(Path(run['run_dir']).name)})</h2><table>"
        + "".join(f"<tr><th>{html.escape(label)}</th><td style='text-align:left'>{html.escape(value)}</td></tr>"
                  for label, value in provenance(run)) + "</table>" for run in runs)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{where}<h2>Results</h2><table><tr>{head}</tr>{trs}</table>{figures}"
            "</body></html>")


def write_report(runs: list[dict], html_path: str | Path, markdown_path: str | Path | None = None) -> None:
    from llmopt.core.io import write_text

    write_text(html_path, html_report(runs))
    if markdown_path:
        write_text(markdown_path, markdown(runs))
