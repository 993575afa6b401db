"""The node's segment-level prefix-cache pool (TokenLake): every engine's KV memory is one cache.

In the daemon (`--pool-mode query|read`):

    member.py      an engine's side: its query service for peers, pins, puts, the step's foreign sources
    attention.py   a step's attention merged with the holders' partial attention (LSE)
    query.py       query mode's path: q rows and (o, lse) in POSIX shared memory, control over zmq;
                   puts of new segments to their homes
    shared_kv.py   read mode's path: an engine's KV cache in shared memory, mapped by its peers
    names.py       where each engine's endpoints live (torch-free)
    ahead.py       when a queued request pins what it reads: near its engine's queue's front
    steal.py       when an idle engine takes a queued request from the busiest (the front asks: Withdraw)
    stuck.py       how long an engine may run nothing while requests wait before they give pins back
    engine_hooks.py  the pool's part of an engine process (the loop calls it)
    heat.py        decayed segment accesses and the heavy hitters (the front's router reads it)
    segments.py    a prefix cache cut into segments of whole pages; the segment size threshold
    dispatch.py    arrivals (or batches) to engines by minimum-cost bipartite matching (scipy)
    cuda_ipc.py    read mode on a GPU: a KV cache's allocation exported once, opened by its peers

The front's side is router.py (`pick_pooled`, `dispatch`) and daemon/api/arrivals.py. Beside them, a
segment-level model of TokenLake's policies drives the segment simulator (sim/pool.py; it homes each
segment by its own hash, as TokenLake does; the router deals a prompt's segments round the engines):

    tree.py        the node-wide prefix tree of segments and where each has replicas
    homes.py       homes by rendezvous hash (the front's router deals a prompt's segments round
                   the engines in hashed orders: segment_homes),
                   heavy-hitter replication, power of two choices, global LRU
    index.py       the control plane: get_prefix_tree, get_cache_load, gen_plans
"""
