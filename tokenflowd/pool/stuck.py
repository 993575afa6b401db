"""How long an engine of the pool may sit with requests waiting, none running and nothing admitted
before its waiting requests give their pins back (pool/engine_hooks.py `_unblock`, and the node
simulator's): a few steps' worth, since a step that admits nothing now and then is not a deadlock."""

STUCK_SECONDS = 0.5
