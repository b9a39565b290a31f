"""An OpenAI-compatible HTTP server over the runtime engine."""
