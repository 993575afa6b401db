"""The node's segment-level prefix-cache pool (TokenLake): every engine's KV memory is one cache.

    segments.py    a prefix cache cut into segments of whole pages; the segment size threshold
    tree.py        the node-wide prefix tree of segments and where each has replicas
    placement.py   homes by hash, heavy-hitter replication, power of two choices, global LRU
    dispatch.py    batches to engines by minimum-cost bipartite matching (scipy)
    index.py       the control plane: get_prefix_tree, get_cache_load, gen_plans
"""
