"""Everything about KV pages: where they live, how they move, and who holds them.

    pages.py     PagePool (reference counts, the prefix cache), chained page keys, cdiv
    tiers.py     KVTier: DeviceTier, HostTier (pinned on a GPU), DiskTier (a file under the state
                 directory), NullHostTier (no host tier: nobody branches on its absence)
    copier.py    Copier lanes: ThreadCopier (CPU), CudaCopier (a CUDA stream per direction)
    manager.py   KVCacheManager: block tables and host tables, prefix matches over every tier,
                 write-through with chunked writing, preempt / load, t_IO

    build.py     build_kv: the engine's tiers from its configuration

The scheduler talks to KVCacheManager only; nothing outside this package touches a page. The
package imports nothing of the engine: a request is what kv.manager.KVRequest describes.
"""
