"""llmopt: make Hugging Face causal LMs smaller and faster, and prove it."""

__version__ = "0.1.0"
