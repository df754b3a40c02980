"""Test-wide settings: hypothesis prints how to reproduce every failure; aggregation uses
the C kernel (built on first use) as the ``p2ptrain`` command does; a failure is printed
when it happens; a test stuck past its timeout has its processes killed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from p2ptrain.store.kernel_build import ensure_kernel
from tests.support.watchdog import Watchdog

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

#: The last lines of a failure's report printed when it happens.
_FAILURE_LINES = 60
#: xdist's controller's terminal reporter (its workers print nothing), once configured.
_TERMINAL: dict[str, Any] = {}
#: Seconds past pytest-timeout's limit before the watchdog kills what a test started (the
#: ini's faulthandler_timeout has printed every thread's stack by then).
_WATCHDOG_AFTER_S = 60.0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failure is printed as it happens, not only in the summary at the end: a run stopped
    before its end (CI's cap) still shows what failed."""
    terminal = _TERMINAL.get("reporter")
    if not report.failed or terminal is None:
        return
    terminal.write_line("")
    terminal.write_line(f"FAILED {report.nodeid} (in {report.when}):", red=True)
    for line in report.longreprtext.splitlines()[-_FAILURE_LINES:]:
        terminal.write_line(line)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        _TERMINAL["reporter"] = config.pluginmanager.get_plugin("terminalreporter")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0] if marker and marker.args else item.config.getini("timeout") or 0)
    watchdog = Watchdog(item.nodeid, limit + _WATCHDOG_AFTER_S) if limit > 0 else None
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.cancel()
