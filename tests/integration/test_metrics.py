"""``/metrics``: typed Prometheus families that say what ``p2ptrain status --json`` says.

One network for the module: a seed; two validators (q = 2; validator-1 also reduces and
evaluates, validator-0 stops at height :data:`WINDOWS`, so no window after it can be
certified and everyone stays there); two honest trainers, trainer-0 with ``--metrics-listen``
(a trainer serves nothing else); and a trainer whose updates are absurdly large, so that the
heads reject them with a reason. While the chain grows, every node's ``/metrics`` is
scraped again and again (byte counters must never go down); once it stopped at
:data:`WINDOWS`, each node's ``/metrics`` and ``status --json`` must agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.faulty_node import FAULT_ENV
from tests.support.local_net import Net, new_net

pytestmark = pytest.mark.integration

WINDOWS = 3
FAULTY = [sys.executable, "-m", "tests.support.faulty_node"]
SCRAPED = ("seed", "validator-1", "trainer-0")


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    net = new_net(tmp_path_factory.mktemp("metrics"))
    try:
        path = net.write_experiment(
            validators=["validator-0", "validator-1"],
            reducers=["validator-1"],
            quorum=2,
            min_updates=2,
            max_updates=3,
        )
        net.start("seed", "seed", args=["--experiment-toml", str(path)])
        net.wait_ready(["seed"])
        net.start("validator-0", "validator", windows=WINDOWS)
        net.start("validator-1", ["validator", "reducer"], args=["--evaluate"])
        net.start("trainer-0", "trainer", args=["--metrics-listen", "127.0.0.1:0"])
        net.start("trainer-1", "trainer")
        net.start("trainer-bad", "trainer", program=FAULTY, env={FAULT_ENV: "update:scale:1000"})
        net.wait_ready(["validator-0", "validator-1", "trainer-0", "trainer-1", "trainer-bad"])
        yield net
    finally:
        net.close()


def _address(net: Net, name: str) -> str:
    ready = net.events("ready", name)[-1]
    address = ready["metrics_address"] if name == "trainer-0" else ready["address"]
    net.check(address is not None, f"{name} serves no /metrics: {ready}")
    return str(address).split("#", 1)[0]


def _scrape(net: Net, name: str) -> str:
    with urllib.request.urlopen(f"{_address(net, name)}/metrics", timeout=10) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain"), answer.headers
        return str(answer.read().decode())


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _status(net: Net, name: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "status", str(net.data_dir(name)), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    status: dict[str, Any] = json.loads(out.stdout)
    return status


def test_metrics_agree_with_status_and_bytes_never_decrease(net: Net) -> None:
    # while the chain grows: scrape each node at every height it reaches
    scrapes: dict[str, list[str]] = {name: [] for name in SCRAPED}
    for height in range(1, WINDOWS + 1):
        for name in SCRAPED:
            net.wait_height(name, height, 120)
            scrapes[name].append(_scrape(net, name))
    # validator-0 stopped at WINDOWS: nothing can be certified after it
    net.wait_exits(["validator-0"], 60)
    for name in SCRAPED:
        net.wait_until(
            f"{name}'s status file to say height {WINDOWS}",
            30,
            lambda name=name: net.status(name)["height"] == WINDOWS,
        )
        scrapes[name].append(_scrape(net, name))

    rejected_anywhere = 0
    for name in SCRAPED:
        text = scrapes[name][-1]
        families = list(text_string_to_metric_families(text))
        # every family is typed and explained, and the raw text says so too
        for family in families:
            assert family.type != "unknown", f"{name}: {family.name} has no TYPE"
            assert family.documentation, f"{name}: {family.name} has no HELP"
            assert f"# HELP {family.name}" in text
            assert f"# TYPE {family.name}" in text
        types = {f.name: f.type for f in families}
        for counter in (
            "p2ptrain_windows_certified",
            "p2ptrain_updates_accepted",
            "p2ptrain_updates_rejected",
            "p2ptrain_bytes_sent",
            "p2ptrain_bytes_received",
        ):
            assert types.get(counter) == "counter", (name, counter, types.get(counter))
        assert types["p2ptrain_height"] == "gauge"
        assert types["p2ptrain_phase_seconds"] == "histogram"

        # the same figures as `p2ptrain status --json`, at the same height
        status = _status(net, name)
        samples = _samples(text)
        assert status["height"] == WINDOWS
        assert samples["p2ptrain_height", ()] == status["height"]
        assert samples["p2ptrain_windows_certified_total", ()] == status["windows_certified"]
        assert status["windows_certified"] == WINDOWS
        # a validator names the aggregation backend it used (this checkout's editable
        # install compiled the kernel into the package where it had a compiler)
        backend = status["aggregation_backend"]
        if name == "validator-1":
            assert backend is not None and backend.startswith(("native (", "torch ("))
        if backend is not None:
            # an info family: the text exposition renders it as a gauge of 1
            assert types["p2ptrain_aggregation_info"] == "gauge"
            assert samples["p2ptrain_aggregation_info", (("backend", backend),)] == 1
        assert samples["p2ptrain_updates_accepted_total", ()] == status["updates_accepted"]
        rejected = {
            dict(labels)["reason"]: value
            for (sample, labels), value in samples.items()
            if sample == "p2ptrain_updates_rejected_total"
        }
        assert rejected == status["updates_rejected"], name
        rejected_anywhere += sum(rejected.values())
        # bytes go on moving at a stopped height (pings, window syncs): only their kinds match
        for direction in ("sent", "received"):
            kinds = {
                dict(labels)["kind"]
                for (sample, labels), _ in samples.items()
                if sample == f"p2ptrain_bytes_{direction}_total"
            }
            assert kinds == set(status[f"bytes_{direction}_by_kind"]), (name, direction)

        # byte counters never go down, scrape after scrape
        for earlier, later in zip(scrapes[name], scrapes[name][1:], strict=False):
            before, after = _samples(earlier), _samples(later)
            for key, value in before.items():
                if key[0].startswith(("p2ptrain_bytes_", "p2ptrain_wire_bytes_")):
                    assert after[key] >= value, f"{name}: {key} went down: {value} -> {after[key]}"

    # every height accepted the honest updates, and the absurd ones were rejected
    seed = _samples(scrapes["seed"][-1])
    assert seed["p2ptrain_updates_accepted_total", ()] >= WINDOWS
    assert rejected_anywhere > 0, "no node counted the faulty trainer's rejected updates"
    trainer = _samples(scrapes["trainer-0"][-1])
    assert trainer["p2ptrain_phase_seconds_count", (("phase", "train"),)] >= WINDOWS
    assert trainer["p2ptrain_bytes_sent_total", (("kind", "update"),)] > 0
    assert 0 < trainer["p2ptrain_compute_utilisation", ()] <= 1
    validator = _samples(scrapes["validator-1"][-1])
    assert validator["p2ptrain_bytes_received_total", (("kind", "update"),)] > 0
    assert validator["p2ptrain_phase_seconds_count", (("phase", "attest"),)] >= WINDOWS
    assert validator["p2ptrain_validation_loss", ()] > 0


def test_the_main_server_keeps_metrics_and_dashboard_apart_from_peers(net: Net) -> None:
    # the dashboard's data is served on an open network, and names the node's height
    seed = _address(net, "seed")
    net.wait_height("seed", 1, 60)  # a window certified: the history shows it
    with urllib.request.urlopen(f"{seed}/api/snapshot", timeout=10) as answer:
        snapshot = json.loads(answer.read())
    assert snapshot["status"]["peer_id"] == net.status("seed")["peer_id"]
    assert [w["height"] for w in snapshot["windows"]][:1] == [1]
    with urllib.request.urlopen(f"{seed}/", timeout=10) as answer:
        assert b"/dashboard/dashboard.js" in answer.read()
    # the records stay behind the network's admission
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{seed}/v1/status", timeout=10)
    assert refused.value.code == 401


def test_dashboard_of_a_data_directory(net: Net) -> None:
    """`p2ptrain dashboard --dir` serves what a node keeps in its directory."""
    history = net.data_dir("seed") / "history.json"  # written at the first certified head
    net.wait_until(
        f"the seed's history to reach height {WINDOWS}",
        60,
        lambda: history.exists() and f'"height":{WINDOWS}' in history.read_text(),
    )
    command = [sys.executable, "-m", "p2ptrain", "dashboard", "--dir", str(net.data_dir("seed"))]
    server = subprocess.Popen(
        [*command, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # "dashboard of DIR at http://HOST:PORT/ (...)"
        address = line.split(" at ", 1)[1].split("/ ", 1)[0]
        with urllib.request.urlopen(f"{address}/api/snapshot", timeout=10) as answer:
            snapshot = json.loads(answer.read())
        with urllib.request.urlopen(f"{address}/metrics", timeout=10) as answer:
            metrics = _samples(answer.read().decode())
    finally:
        server.terminate()
        server.wait(timeout=30)
    windows = snapshot["windows"]
    assert [w["height"] for w in windows] == list(range(1, WINDOWS + 1)), line
    assert all(w["signers"] for w in windows)
    assert any(u["outcome"] == "rejected" and u["reason"] for w in windows for u in w["updates"])
    assert {p["peer_id"] for p in snapshot["peers"]}, "the seed knew no peers"
    assert metrics["p2ptrain_height", ()] == snapshot["status"]["height"] == WINDOWS
    assert server.returncode == 0, "the dashboard did not stop cleanly on SIGTERM"
    # a directory that is no node's is refused with the reason
    refused = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "dashboard", "--dir", str(net.workdir / "nowhere")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "has no status file" in refused.stderr
