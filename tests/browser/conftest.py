"""Fixtures for the dashboard tests: headless Chromium driven by selenium, and a running
network whose chain has validation losses and a rejected update to show.

``browser`` skips, saying why and what to do, when selenium is not importable, Chromium or
its driver is not installed, or the driver does not start; ``chromium`` finds that out once
per module, so that a module asking for it first skips before starting its network. Every
page load is bounded (``set_page_load_timeout``); the tests wait on the page with
``WebDriverWait``.

:func:`start_rejection_net` starts a real network (seed, one evaluating validator, two honest
trainers and one whose updates are scaled far beyond theirs) and returns it once it is
:data:`WINDOWS` windows long, every head evaluated and the outlier rejected by screening.
``dashboard_net`` is that network for a module; the nodes other than the trainers (which
stop at :data:`WINDOWS`) keep running, so the seed goes on serving its dashboard.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support.faulty_node import FAULT_ENV
from tests.support.local_net import Net, new_net, reaped

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

__all__ = [
    "EVALUATOR",
    "FAULTY_TRAINER",
    "HONEST_TRAINERS",
    "SCALE",
    "WINDOWS",
    "browser",
    "chromium",
    "dashboard_net",
    "rejected_reasons",
    "start_browser",
    "start_rejection_net",
]

INSTALL_HINT = "run `make test` as root to install Debian's chromium and chromium-driver"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage")
WINDOW_SIZE = (1280, 1800)
PAGE_LOAD_TIMEOUT_S = 30

WINDOWS = 3
#: How many times its honest distance from the base the faulty trainer's weights move.
SCALE = 1000
EVALUATOR = "validator-0"
HONEST_TRAINERS = ("trainer-0", "trainer-1")
FAULTY_TRAINER = "trainer-2"
FAULTY = [sys.executable, "-m", "tests.support.faulty_node"]
#: Screening calls an update an outlier by its norm's ratio to the cohort median: with the
#: two honest updates and the faulty one the median is an honest norm and the faulty update
#: is rejected, but with one of each the median is their mean and the *honest* one looks
#: too small. So a window takes all three (it closes as soon as they arrived) and needs two
#: that pass screening: a validator that reduced two (window 1 may close at its deadline
#: before the last trainer published) makes no head and reduces again when the third comes.
MAX_UPDATES = 3
MIN_UPDATES = 2
#: Heights, evaluations and the first rejection; a window takes a few seconds on two cores.
NETWORK_TIMEOUT_S = 240.0
#: How long a window waits for its third update after the first. Every window closes as
#: soon as it is full, so this only bounds how much later than the others a trainer may
#: start: on two loaded cores the last of three trainers to import torch and build its
#: model can be more than the usual 20 s behind, and its window-1 update would miss.
DEADLINE_S = 90.0
#: The seed's copy of the evaluator's last report, after the evaluator published it.
REPORT_TIMEOUT_S = 30.0


# -- the browser -----------------------------------------------------------------------------


def _executable(name: str, debian_path: str) -> str | None:
    if os.access(debian_path, os.X_OK):
        return debian_path
    return shutil.which(name)


def start_browser(size: tuple[int, int] = WINDOW_SIZE) -> WebDriver:
    """A headless Chromium WebDriver with bounded page loads, or a skip saying why not."""
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
    except ImportError as error:
        pytest.skip(f"selenium is not importable ({error}); install the dev extra: make test")
    chromium = _executable("chromium", CHROMIUM)
    chromedriver = _executable("chromedriver", CHROMEDRIVER)
    missing = [
        name
        for name, path in (("chromium", chromium), ("chromedriver", chromedriver))
        if path is None
    ]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: {INSTALL_HINT}")
    assert chromium is not None and chromedriver is not None
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (*CHROMIUM_ARGS, f"--window-size={size[0]},{size[1]}"):
        options.add_argument(argument)
    try:
        driver = webdriver.Chrome(
            options=options, service=webdriver.ChromeService(executable_path=chromedriver)
        )
    except (WebDriverException, OSError) as error:
        text = (getattr(error, "msg", None) or str(error)).strip()
        first = text.splitlines()[0].split("; For documentation")[0] if text else repr(error)
        pytest.skip(f"headless Chromium ({chromium}, {chromedriver}) did not start: {first}")
    try:
        driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
        driver.set_window_size(*size)
    except BaseException:
        driver.quit()
        raise
    return driver


@pytest.fixture(scope="module")
def chromium() -> None:
    """Skip the module's tests at once (before any module-scoped network starts) when
    headless Chromium cannot be driven: one driver is started and quit to find out. A test
    module asks for it first, e.g. ``pytestmark = pytest.mark.usefixtures("chromium")``."""
    start_browser().quit()


@pytest.fixture
def browser(chromium: None) -> Iterator[WebDriver]:
    """A headless Chromium (1280x1800), quit after the test."""
    driver = start_browser()
    try:
        yield driver
    finally:
        driver.quit()


# -- the network -----------------------------------------------------------------------------


def rejected_reasons(net: Net, name: str = FAULTY_TRAINER) -> dict[int, str]:
    """Why the network rejected ``name``'s update, by height, from its ``adopted`` events
    (``update: "rejected: <why>"``), without the ``rejected: `` prefix."""
    prefix = "rejected: "
    return {
        event["height"]: event["update"].removeprefix(prefix)
        for event in net.events("adopted", name)
        if event["update"].startswith(prefix)
    }


def _seen_or_wait(
    net: Net, what: str, timeout_s: float, match: Callable[[str, dict[str, Any]], bool]
) -> None:
    """Return at once if an event seen so far matches, else wait for one."""
    if not any(match(name, event) for _, name, event in net.history):
        net.wait_event(what, timeout_s, match)


def start_rejection_net(workdir: Path) -> Net:
    """Start the network in ``workdir`` and return it at height :data:`WINDOWS` on the seed,
    with :data:`EVALUATOR`'s reports of heads 1..:data:`WINDOWS` (the last one held by the
    seed too) and at least one update of :data:`FAULTY_TRAINER` rejected. The caller closes
    it (it is closed here if starting fails)."""
    net = new_net(workdir)
    try:
        path = net.write_experiment(
            validators=[EVALUATOR],
            quorum=1,
            min_updates=MIN_UPDATES,
            max_updates=MAX_UPDATES,
            deadline_s=DEADLINE_S,
        )
        # the seed keeps every update and proposal (their rejection reasons included)
        net.start("seed", "seed", args=["--experiment-toml", str(path), "--archive"])
        net.wait_ready(["seed"])
        net.note(f"{FAULTY_TRAINER}: {FAULT_ENV}=update:scale:{SCALE}")
        # the validator first: an update published before it listens reaches it late, if at
        # all (window 1's deadline, once passed empty, starts again at its first update)
        net.start(EVALUATOR, "validator", args=["--evaluate"])
        net.wait_ready([EVALUATOR])
        for name in HONEST_TRAINERS:
            net.start(name, "trainer", windows=WINDOWS)
        net.start(
            FAULTY_TRAINER,
            "trainer",
            windows=WINDOWS,
            program=FAULTY,
            env={FAULT_ENV: f"update:scale:{SCALE}"},
        )
        net.wait_ready([*HONEST_TRAINERS, FAULTY_TRAINER])
        net.wait_height("seed", WINDOWS, NETWORK_TIMEOUT_S)
        _seen_or_wait(
            net,
            f"{EVALUATOR} to evaluate head {WINDOWS}",
            NETWORK_TIMEOUT_S,
            lambda n, e: n == EVALUATOR and e["event"] == "evaluated" and e["height"] == WINDOWS,
        )
        _seen_or_wait(
            net,
            f"{FAULTY_TRAINER}'s update to be rejected",
            NETWORK_TIMEOUT_S,
            lambda n, e: (
                n == FAULTY_TRAINER
                and e["event"] == "adopted"
                and e["update"].startswith("rejected: ")
            ),
        )
        net.wait_until(
            f"the seed's status to show {EVALUATOR}'s report of head {WINDOWS}",
            REPORT_TIMEOUT_S,
            lambda: (net.status("seed").get("validation") or {}).get("height") == WINDOWS,
        )
        evaluated = sorted(e["height"] for e in net.events("evaluated", EVALUATOR))
        net.check(
            evaluated == list(range(1, WINDOWS + 1)),
            f"{EVALUATOR} should evaluate every head 1..{WINDOWS} once: {evaluated}",
        )
    except BaseException:
        net.close()
        raise
    return net


@pytest.fixture(scope="module")
def dashboard_net(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Net]:
    """:func:`start_rejection_net` for a module; every process is reaped at its end, and the
    network's diagnosis printed when one of its tests failed."""
    yield from reaped(lambda: start_rejection_net(tmp_path_factory.mktemp("dashboard")), request)
