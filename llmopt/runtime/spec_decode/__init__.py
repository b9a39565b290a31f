"""Speculative decoding: proposers (prompt lookup, a draft model, Medusa heads) guess each sequence's next
tokens; the target verifies them in the engine's batched step (executor.model_runner with verify.py); the
Speculator decides per sequence how many to guess (adaptive.py)."""
