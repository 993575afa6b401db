"""Nodes federate: prefill and decode nodes behind a conductor, with KV moving between them.

    transport.py   the KVTransport seam and its Mooncake Transfer Engine twin (byte runs, probes)
    delivery.py    what a TCP link delivered, from the kernel's socket lists: the links' bandwidth
    streaming.py   in an engine: a prefill node's layer-wise sends, a decode node's reservations
    timing.py      how long a transfer may last before its pages can go to another request
    peers.py       the nodes a node exchanges KV with (--federation-peers), each URL in one spelling
    placement.py   the conductor's choice of a (prefill, decode) pair: Mooncake's Algorithm 1
    rejection.py   early rejection on the current or the predicted decode load (Mooncake §7)
    conductor.py   `tokenflowd conductor`: follows the nodes, places, rejects, proxies the stream

A node's side of the HTTP exchanges is in daemon/api/federation.py."""
