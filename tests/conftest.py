"""Test-wide settings: hypothesis prints how to reproduce every failure; aggregation uses
the C kernel (built on first use) as the ``p2ptrain`` command does."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from p2ptrain.store.kernel_build import ensure_kernel

settings.register_profile(
    "p2ptrain",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    parent=settings.get_profile("p2ptrain"),
    derandomize=False,
)
settings.load_profile("ci" if os.environ.get("CI") else "p2ptrain")
ensure_kernel()


#: The tiers that start real processes: under pytest-xdist (``make test`` runs two
#: workers) each module runs whole on one worker, so that its one shared network is started
#: once, and the modules that share the host's LAN (mDNS on loopback) run on the same worker,
#: one after the other.
_NETWORK_TIERS = frozenset({"integration", "chaos", "browser"})
_ONE_LAN = frozenset({"test_mdns_lan", "test_lan_nodes"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.stem
        if item.path.parent.name in _NETWORK_TIERS:
            group = "lan" if module in _ONE_LAN else f"{item.path.parent.name}/{module}"
            item.add_marker(pytest.mark.xdist_group(group))
