"""MODEL -> artifact: load a model, compress it (llmopt.compress), write it (llmopt.formats), report the facts."""
