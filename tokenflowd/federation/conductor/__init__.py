"""The conductor: one per cluster, in front of the nodes. It places prefill and decode (Mooncake
Alg. 1), rejects early under predicted overload, and sends long prompts to a remote prefill
cluster (PrfaaS)."""
