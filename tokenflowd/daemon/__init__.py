"""The supervisor process: HTTP fronts, engine handles, routing and the prefix index. It never
imports torch (the engine processes compute; this one only moves token ids)."""
