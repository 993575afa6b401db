"""Nodes federate (in progress): moving KV between nodes over a transfer engine (transport.py)."""
