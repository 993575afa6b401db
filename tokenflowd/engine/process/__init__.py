"""One engine process (`python -m tokenflowd.engine.process '<EngineSpec as JSON>'`): the loop
(loop.py), the engine's end of the protocol (endpoint.py) and the pacing of its deltas (pacing.py).
The only place that wires the pool and the federation into an engine."""
