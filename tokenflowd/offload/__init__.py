"""KV offload: where KV goes when it leaves the device, and the lanes that move it there.

    tiers.py     HostTier (host memory, pinned on a GPU), DiskTier (a file under the state directory)
    copier.py    the copier's lanes: ThreadCopier (CPU), CudaCopier (a CUDA stream per direction)
    build.py     build_kv: the engine's KV manager and tiers from its configuration, and the host
                 tier's budget

They implement kv/'s seams (KVTier, Copier): the KV manager (kv/manager.py) drives them and never
imports this package.
"""
