"""`llmopt env`: versions, device, threads, and where data and models are found."""

from __future__ import annotations

from llmopt.cli.options import JsonOpt
from llmopt.cli.output import print_json, print_table


def env(as_json: JsonOpt = False) -> None:
    """Print versions, the compute device, threads and the data and model locations."""
    from llmopt.core.environment import environment_facts

    facts = environment_facts()
    if as_json:
        print_json(facts)
    else:
        print_table("llmopt environment", facts)
