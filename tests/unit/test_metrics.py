"""The front's metrics helpers."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from tokenflowd.daemon.api.metrics import BatchHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in registry.collect() for s in metric.samples if not s.name.endswith("_created")}


def test_observe_many_is_count_observes():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch = BatchHistogram("h", "h", ["engine"], buckets=BUCKETS, registry=ours).labels("0")
    plain = Histogram("h", "h", ["engine"], buckets=BUCKETS, registry=theirs).labels("0")
    for amount, count in [(0.0005, 3), (0.05, 1), (0.5, 7), (2.0, 2), (0.01, 4), (0.3, 0)]:
        batch.observe_many(amount, count)
        for _ in range(count):
            plain.observe(amount)
    a, b = _samples(ours), _samples(theirs)
    assert a.keys() == b.keys()
    assert all(a[k] == pytest.approx(b[k]) for k in a)  # the sum, added at once, rounds differently
    assert _samples(ours)[("h_count", (("engine", "0"),))] == 17
