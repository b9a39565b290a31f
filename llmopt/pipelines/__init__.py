"""MODEL -> artifact: load a model, compress it (llmopt.compress), write it (llmopt.export), report the facts."""
