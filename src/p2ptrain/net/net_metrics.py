"""The network layer's figures as typed Prometheus families.

:func:`net_families` turns one :class:`~p2ptrain.net.node.NetNodeStatistics` snapshot into
``prometheus_client`` metric families: counters (``_total`` in the exposition) for what only
grows, gauges for what goes up and down, each with its help text. A node's full ``/metrics``
(:mod:`p2ptrain.observe.telemetry`) adds the training figures to these; a bare
:class:`~p2ptrain.net.node.NetNode` answers these alone (:func:`exposition`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:  # net.node imports this module
    from p2ptrain.net.node import NetNodeStatistics

__all__ = ["PREFIX", "FamilySource", "exposition", "net_families"]

PREFIX = "p2ptrain_"

#: What a node's ``/metrics`` is made of, read at once at each scrape.
FamilySource = Callable[[], Iterable[Metric]]

#: Per statistics group: help text of each figure, and which are gauges (the rest count up).
_HELP: dict[str, dict[str, str]] = {
    "gossip": {
        "connections": "Gossip connections open now",
        "topics": "Gossip topics this node subscribes to",
        "published": "Gossip messages this node published",
        "delivered": "Gossip messages delivered to this node's handlers",
        "forwarded": "Gossip messages passed on to neighbours (our bodies, others' ids)",
        "duplicates": "Gossip messages received again and dropped",
        "rejected": "Gossip messages refused by a topic validator (counted against the sender)",
        "ignored": "Gossip messages refused without blame (e.g. for windows far ahead)",
        "unwanted": "Gossip messages on topics this node does not subscribe to",
        "seen": "Gossip message ids remembered to drop duplicates",
        "bytes_sent": "Bytes of gossip frames queued to neighbours",
        "announced": "Gossip message ids announced to neighbours (have)",
        "wanted": "Gossip message bodies asked of neighbours (want)",
        "served": "Gossip message bodies sent to neighbours that asked",
    },
    "peers": {
        "peers": "Peers with a valid signed record known to this node",
        "banned": "Peers banned now for misbehaving",
        "strikes": "Strikes counted against peers",
        "records_rejected": "Peer records refused (bad signature, other network, stale)",
    },
    "relay": {
        "requests": "Requests relayed to private peers",
        "bytes_relayed": "Bytes relayed to private peers",
        "failures": "Relayed requests that failed",
        "in_flight": "Relayed requests in flight now",
    },
    "server": {
        "requests": "HTTP requests to this node's server",
        "refused": "HTTP requests refused (credentials, bans, rate limits)",
        "bad_requests": "Malformed HTTP requests",
        "blobs_served": "Blobs served to peers",
        "blobs_received": "Blobs pushed to this node and stored",
        "bytes_received": "Bytes of blobs pushed to this node and stored",
    },
}
_GAUGES = {
    ("gossip", "connections"),
    ("gossip", "topics"),
    ("gossip", "seen"),
    ("peers", "peers"),
    ("peers", "banned"),
    ("relay", "in_flight"),
}


def net_families(stats: NetNodeStatistics) -> Iterator[Metric]:
    """The families of one :class:`~p2ptrain.net.node.NetNodeStatistics`."""
    connections = GaugeMetricFamily(
        PREFIX + "net_connections",
        "Gossip connections open now, by who dialled",
        labels=["direction"],
    )
    connections.add_metric(["outbound"], stats.outbound)
    connections.add_metric(["inbound"], stats.inbound)
    yield connections
    yield CounterMetricFamily(
        PREFIX + "connections_opened",
        "Gossip connections registered since the node started (churn grows it while idle)",
        value=stats.connections_opened,
    )
    yield CounterMetricFamily(
        PREFIX + "gossip_bytes_received",
        "Bytes of gossip frames received from neighbours",
        value=stats.gossip_bytes_received,
    )
    for group, helps in _HELP.items():
        values: Any = getattr(stats, group)
        if values is None:  # no server: an outbound-only node
            continue
        for field in fields(values):
            name = f"{PREFIX}{group}_{field.name}"
            value = getattr(values, field.name)
            if (group, field.name) in _GAUGES:
                yield GaugeMetricFamily(name, helps[field.name], value=value)
            else:
                yield CounterMetricFamily(name, helps[field.name], value=value)


class _Families:
    def __init__(self, source: FamilySource) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        return list(self._source())


def exposition(source: FamilySource, registry: CollectorRegistry | None = None) -> bytes:
    """The Prometheus text of ``source``'s families (and of ``registry``'s own metrics)."""
    registry = registry or CollectorRegistry(auto_describe=False)
    collector = _Families(source)
    registry.register(collector)
    try:
        return generate_latest(registry)
    finally:
        registry.unregister(collector)
