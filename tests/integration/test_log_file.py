"""``--log-file`` with ``--log-format json``: a real seed appends one JSON object a line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.local_net import Net, local_net

__all__ = ["local_net"]  # the fixture

pytestmark = pytest.mark.integration

KEYS = {"time", "level", "logger", "message", "pid"}
UTC_MILLISECONDS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def _entries(path: Path) -> list[dict[str, Any]]:
    """The complete lines of the log file so far, parsed (a line being written is not)."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def test_a_seed_logs_json_lines_to_its_log_file(local_net: Net) -> None:
    net = local_net
    path = net.workdir / "seed-logs" / "seed.jsonl"  # its directory does not exist yet
    experiment = net.write_experiment(validators=["validator-0"], quorum=1, max_updates=1)
    args = ["--experiment-toml", str(experiment), "--log-file", str(path), "--log-format", "json"]
    net.start("seed", "seed", args=args)
    net.wait_ready(["seed"])
    net.wait_until(
        "the seed to log that it is up, at INFO, in its log file",
        30,
        lambda: any(e["level"] == "INFO" and " up " in e["message"] for e in _entries(path)),
    )
    net.stop(["seed"])
    lines = path.read_text(encoding="utf-8").splitlines()
    entries = [json.loads(line) for line in lines]  # every line, the last one included
    assert entries and all(KEYS <= set(e) <= KEYS | {"exception", "stack"} for e in entries)
    assert all(UTC_MILLISECONDS.fullmatch(e["time"]) for e in entries), entries[0]["time"]
    assert {e["pid"] for e in entries} == {net.network.nodes["seed"].process.pid}
    assert {e["level"] for e in entries} <= {"INFO", "WARNING", "ERROR", "CRITICAL"}  # no -v
    up = [e for e in entries if e["logger"] == "p2ptrain.net.node" and " up " in e["message"]]
    assert up and up[0]["level"] == "INFO", entries
