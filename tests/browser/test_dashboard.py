"""The seed's dashboard in headless Chromium, on a live network (``dashboard_net``: three
certified windows, each head evaluated by a validator, one trainer's updates rejected).

The page renders what the network did: the height in its header, a loss chart whose
validation points (``#loss-chart circle.point.val`` with ``data-height`` and ``data-loss``)
are the median of the evaluators' signed reports for each certified head, and rejected
updates (class ``rejected``) with the reason screening gave. The page updates itself over
server-sent events; every check polls the DOM with a bounded ``WebDriverWait``. Screenshots
(desktop and phone width) are saved under the test's ``tmp_path`` and their paths printed.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip(
    "selenium", reason="selenium is not importable; install the dev extra (make test)"
)

from selenium.common.exceptions import (
    StaleElementReferenceException,
    TimeoutException,
    WebDriverException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.wait import WebDriverWait

from tests.browser.conftest import WINDOWS, rejected_reasons
from tests.support.local_net import Net

# ``chromium`` first: without a browser the module skips before its network starts
pytestmark = [
    pytest.mark.browser,
    pytest.mark.integration,
    pytest.mark.usefixtures("chromium"),
]

#: Bound on every wait for the page to show something (it loads, then follows live events).
PAGE_WAIT_S = 30.0
POLL_S = 0.2
SNAPSHOT_TIMEOUT_S = 10.0
PHONE_SIZE = (390, 1600)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: How much of a rejection reason the page must show (it may shorten long ones).
REASON_CHARS = 30
LOSS_POINTS_JS = """
return Array.from(document.querySelectorAll('#loss-chart circle.point.val')).map(
    c => [c.getAttribute('data-height'), c.getAttribute('data-loss')]);
"""

T = TypeVar("T")


# -- reading the network and the page -------------------------------------------------------


def dashboard_url(net: Net) -> str:
    """The seed's dashboard: the root of the address its ``ready`` event gave."""
    address = str(net.events("ready", "seed")[-1]["address"])
    return address.rstrip("/") + "/"


def median_validation_losses(net: Net) -> dict[int, float]:
    """For each certified height, the median of the losses the evaluators reported for the
    seed's head at that height (their ``evaluated`` events carry what they signed)."""
    heads = {e["height"]: e["head_id"] for e in net.events("adopted", "seed")}
    losses: dict[int, list[float]] = {}
    for event in net.events("evaluated"):
        if heads.get(event["height"]) == event["head_id"]:
            losses.setdefault(event["height"], []).append(float(event["loss"]))
    return {height: statistics.median(values) for height, values in sorted(losses.items())}


def first_rejection(net: Net) -> str:
    """The first reason the faulty trainer was told its update was rejected for."""
    reasons = rejected_reasons(net)
    net.check(bool(reasons), "the faulty trainer reported no rejected update")
    return reasons[min(reasons)]


def page_text(driver: WebDriver) -> str:
    return str(driver.find_element(By.TAG_NAME, "body").text)


def loss_points(driver: WebDriver) -> dict[int, float]:
    """The loss chart's validation points, height -> loss, read in one go (the chart may be
    redrawn by a live update between two element reads)."""
    rows = driver.execute_script(LOSS_POINTS_JS)
    points: dict[int, float] = {}
    for height, loss in rows:
        assert height is not None and loss is not None, f"a point without data: {rows}"
        assert int(height) not in points, f"two validation points at height {height}: {rows}"
        points[int(height)] = float(loss)
    return points


def wait_for(
    driver: WebDriver,
    what: str,
    read: Callable[[WebDriver], T],
    done: Callable[[T], bool],
    timeout_s: float = PAGE_WAIT_S,
) -> T:
    """Poll ``read(driver)`` until ``done`` holds for what it read, and return that; fail
    after ``timeout_s`` naming ``what``, the last reading and what the page shows."""
    last: list[T] = []

    def ready(d: WebDriver) -> bool:
        value = read(d)
        last[:] = [value]
        return done(value)

    try:
        WebDriverWait(
            driver,
            timeout_s,
            poll_frequency=POLL_S,
            ignored_exceptions=(StaleElementReferenceException,),
        ).until(ready)
    except TimeoutException:
        seen = repr(last[0])[:500] if last else "nothing (every read raised)"
        try:
            shown = page_text(driver)[:1500]
        except WebDriverException as error:
            shown = f"(unreadable: {error.msg})"
        raise AssertionError(
            f"timed out after {timeout_s:.0f} s waiting for {what} on {driver.current_url}\n"
            f"last read: {seen}\npage title: {driver.title!r}\npage text:\n{shown}"
        ) from None
    return last[0]


def open_dashboard(driver: WebDriver, net: Net) -> str:
    url = dashboard_url(net)
    driver.get(url)  # bounded by the driver's page-load timeout
    return url


def header_shows_height(driver: WebDriver, height: int) -> str:
    return wait_for(
        driver,
        f"the header to show height {height}",
        lambda d: str(d.find_element(By.TAG_NAME, "header").text),
        lambda text: re.search(rf"\bheight\W*{height}\b", text, re.IGNORECASE) is not None,
    )


def png_width(path: Path) -> int:
    """The width in a PNG file's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big")


# -- the tests ------------------------------------------------------------------------------


def test_the_page_shows_the_height(browser: WebDriver, dashboard_net: Net) -> None:
    open_dashboard(browser, dashboard_net)
    header = header_shows_height(browser, WINDOWS)
    assert dashboard_net.heights["seed"] == WINDOWS, header


def test_the_loss_chart_shows_the_median_reported_validation_losses(
    browser: WebDriver, dashboard_net: Net
) -> None:
    expected = median_validation_losses(dashboard_net)
    assert sorted(expected) == list(range(1, WINDOWS + 1)), expected
    open_dashboard(browser, dashboard_net)
    points = wait_for(
        browser,
        f"validation points for heights 1..{WINDOWS} in #loss-chart",
        loss_points,
        lambda found: set(expected) <= set(found),
    )
    assert sorted(points) == sorted(expected), (points, expected)
    for height, loss in expected.items():
        assert math.isclose(points[height], loss, rel_tol=1e-9), (height, points, expected)


def test_a_rejected_update_shows_its_reason(browser: WebDriver, dashboard_net: Net) -> None:
    reason = first_rejection(dashboard_net)
    shown = reason[:REASON_CHARS]
    open_dashboard(browser, dashboard_net)
    wait_for(browser, f"the rejection reason {shown!r} in the page text", page_text,
             lambda text: shown in text)  # fmt: skip
    rejected = browser.find_elements(By.CSS_SELECTOR, ".rejected")
    assert rejected, "no element of class 'rejected' on the page"


def test_screenshots(browser: WebDriver, dashboard_net: Net, tmp_path: Path) -> None:
    open_dashboard(browser, dashboard_net)
    header_shows_height(browser, WINDOWS)  # the page has drawn the network's snapshot
    desktop = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(desktop))
    browser.set_window_size(*PHONE_SIZE)
    wait_for(browser, f"a viewport at most {PHONE_SIZE[0]} px wide",
             lambda d: int(d.execute_script("return window.innerWidth")),
             lambda width: width <= PHONE_SIZE[0])  # fmt: skip
    phone = tmp_path / "dashboard-phone.png"
    assert browser.save_screenshot(str(phone))
    print(f"dashboard screenshots: {desktop} {phone}")
    assert png_width(phone) < png_width(desktop), (png_width(phone), png_width(desktop))
    assert desktop.stat().st_size > 1000 and phone.stat().st_size > 1000


def test_the_snapshot_agrees_with_the_network(dashboard_net: Net) -> None:
    """``/api/snapshot``, what the page is drawn from: the status's height, each window's
    validation loss and the rejected update with its reason."""
    url = dashboard_url(dashboard_net) + "api/snapshot"
    with urllib.request.urlopen(url, timeout=SNAPSHOT_TIMEOUT_S) as answer:
        snapshot: dict[str, Any] = json.load(answer)
    assert snapshot["status"]["height"] == WINDOWS
    windows = {w["height"]: w for w in snapshot["windows"]}
    expected = median_validation_losses(dashboard_net)
    for height, loss in expected.items():
        got = windows[height]["validation_loss"]
        assert got is not None and math.isclose(got, loss, rel_tol=1e-9), (height, got, loss)
    reason = first_rejection(dashboard_net)
    rejected = [
        update
        for window in snapshot["windows"]
        for update in window["updates"]
        if str(update["outcome"]).startswith("rejected")
    ]
    assert any(reason[:REASON_CHARS] in str(u["reason"]) for u in rejected), (reason, rejected)
