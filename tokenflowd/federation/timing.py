"""How long a transfer between nodes may last, in one place: the decode node frees the pages of a
transfer it gave up on only once the prefill node can no longer write into them.

    order sent ─── send window ───┤ no write starts after it (the prefill node enforces it)
                                  └─ transfer timeout ─┤ its last batch has ended (MC_TRANSFER_TIMEOUT)
    reserved ──────────────────── horizon ───────────────┤ the pages may go to another request

Both nodes take `timeout` from their --kv-transfer-timeout (the cluster gives them the same).
Torch-free: the fronts use it too."""
from __future__ import annotations

MARGIN = 5.0  # s for clocks that tick at slightly different rates and a batch's last bytes


def send_window(timeout: float) -> float:
    """s after the decode node sends its order in which the prefill node may start writes: its queue
    and the prompt's compute must fit (a prefill later than that fails; the decode node computes it)."""
    return 4 * timeout


def horizon(timeout: float) -> float:
    """s after a reservation by which the prefill node can write no more into its pages."""
    return send_window(timeout) + timeout + MARGIN
