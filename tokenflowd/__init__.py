"""tokenflowd: a buffer-aware LLM serving daemon for streaming chat under bursts."""

__version__ = "0.1.0"
