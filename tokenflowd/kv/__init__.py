"""Everything about KV pages: where they live, how they move, and who holds them.

    pages.py     PagePool (reference counts, the prefix cache), chained page keys, cdiv
    tiers.py     the KVTier seam, DeviceTier, NullHostTier (no host tier: nobody branches on its
                 absence); the host and disk tiers are offload/'s
    copier.py    the Copier seam (lanes, jobs, bandwidth); its lanes are offload/'s
    manager.py   KVCacheManager: block tables and host tables, prefix matches over every tier,
                 write-through with chunked writing, preempt / load, t_IO
    staging.py   pages gathered into one contiguous run and scattered back

The scheduler talks to KVCacheManager only; nothing outside kv/ and offload/ touches a page. The
package imports nothing of the engine: a request is what kv.manager.KVRequest describes.
"""
