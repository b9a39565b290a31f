"""Comparison reports from recipe runs: Markdown tables and a self-contained HTML page with plots."""
