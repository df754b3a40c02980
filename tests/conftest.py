"""Test-wide settings: hypothesis prints how to reproduce every failure."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
