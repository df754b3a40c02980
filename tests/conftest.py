"""Test-wide settings: hypothesis prints how to reproduce every failure; aggregation uses
the C kernel (built on first use) as the ``p2ptrain`` command does."""

from __future__ import annotations

import os

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
