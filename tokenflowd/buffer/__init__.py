"""The token-buffer model and the scheduling policies that consume it."""
