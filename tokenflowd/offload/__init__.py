"""KV offload: where KV goes when it leaves the device, the lanes that move it there, and the
traffic between the two.

    tiers.py     HostTier (host memory, pinned on a GPU), DiskTier (a file under the state directory)
    copier.py    the copier's lanes: ThreadCopier (CPU), CudaCopier (a CUDA stream per direction)
    traffic.py   HostOffloader: write-through and write-back, loads, polls, t_IO
    build.py     build_kv: the engine's KV manager, offloader and tiers from its configuration, and
                 the host tier's budget

They implement kv/'s seams (KVTier, Copier, Offloader): the KV manager (kv/manager.py) drives them
and never imports this package.
"""
