"""Everything about KV pages: where they live, how they move, and who holds them.

    pages.py      PagePool (reference counts, the prefix cache), chained page keys, cdiv
    state.py      what the manager reads of a request (Request) and keeps for it (RequestKV)
    tiers.py      the KVTier seam, DeviceTier, NullHostTier; the host and disk tiers are offload/'s
    copier.py     the Copier seam (lanes, jobs, bandwidth); its lanes are offload/'s
    offloader.py  the Offloader seam: the traffic between device and host, as the manager drives
                  it; NullOffloader where there is no host tier (nobody branches on its absence)
    manager.py    KVCacheManager: block tables, prefix matches over every tier, admit / grow /
                  preempt / load / free, pages other nodes write
    staging.py    pages gathered into one contiguous run and scattered back

The scheduler talks to KVCacheManager only; nothing outside kv/ and offload/ touches a page. The
package imports nothing of the engine, nor of offload/: a request is what kv.state.Request
describes, and offload/ implements kv's seams.
"""
