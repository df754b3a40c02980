"""The torch.distributed examples of docs/collectives.md (examples/collectives), each run as
that page says: torchrun, 2 ranks, CPU, gloo. The collectives give the values computed here
by hand; DDP, FSDP2 and pipeline parallel training lower the loss; DDP's replicas end equal,
FSDP2's ranks each hold half the weights and learn what DDP learns.

The four torchrun launches start together (each in its own session, its output in files) and
each test waits for its own: most of an example's time is torch's imports, one core each,
and side by side the examples keep both cores busy. The fixture kills what is left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "collectives"
NAMES = ("collectives", "ddp", "fsdp2", "pipeline")
RANKS = 2
STEPS = 30  # the training examples' STEPS
AVERAGE_OVER = 5  # their AVERAGE_OVER
#: From launch to exit, for each example, with the four running side by side on 2 cores
#: (about 40 s for all four on an idle machine).
TIMEOUT_S = 150
STOP_GRACE_S = 15


@dataclass
class Launch:
    name: str
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    deadline: float  # time.monotonic()

    def lines(self) -> list[dict[str, Any]]:
        """The example's JSON lines, once it has exited 0 (within TIMEOUT_S of its launch)."""
        try:
            code = self.process.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(self.process)
            pytest.fail(f"{self.name}.py ran past {TIMEOUT_S} s:\n{_tail(self.stderr)}")
        assert code == 0, f"{self.name}.py exited {code}:\n{_tail(self.stderr)}"
        text = self.stdout.read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:]


def _kill(process: subprocess.Popen[bytes]) -> None:
    """Stop torchrun and its ranks, then reap torchrun. SIGTERM first: torchrun stops the ranks
    it started, each in a session of its own; what is left after STOP_GRACE_S gets SIGKILL,
    torchrun's session and each rank's."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            for session in (*_children(process.pid), process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(session, signal.SIGKILL)
    process.wait()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc/*/stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            state_and_after = stat.read_text().rsplit(")", 1)[1].split()
            if int(state_and_after[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _torchrun(name: str, directory: Path) -> Launch:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", str(RANKS), "--max-restarts", "0", str(EXAMPLES / f"{name}.py")]
    stdout, stderr = directory / f"{name}.out", directory / f"{name}.err"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    return Launch(name, process, stdout, stderr, time.monotonic() + TIMEOUT_S)


@pytest.fixture(scope="module", name="launches")
def launches_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Launch]]:
    directory = tmp_path_factory.mktemp("collectives")
    launches: dict[str, Launch] = {}
    try:
        for name in NAMES:
            launches[name] = _torchrun(name, directory)
        yield launches
    finally:
        for launch in launches.values():
            _kill(launch.process)


def _by_rank(lines: list[dict[str, Any]], **match: Any) -> dict[int, list[dict[str, Any]]]:
    """The lines that have every key of ``match`` (with its value, unless that is None)."""
    ranks: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        if all(k in line and (v is None or line[k] == v) for k, v in match.items()):
            ranks.setdefault(line["rank"], []).append(line)
    return ranks


def _check_training(lines: list[dict[str, Any]], ranks: list[int]) -> dict[int, dict[str, Any]]:
    """Each of ``ranks`` reported every step and a summary whose losses are its steps' and
    fell by a quarter or more; the summaries, by rank."""
    steps, summaries = _by_rank(lines, step=None), _by_rank(lines, first_loss=None)
    assert sorted(steps) == sorted(summaries) == ranks, lines
    for rank in ranks:
        losses = [line["loss"] for line in steps[rank]]
        assert [line["step"] for line in steps[rank]] == list(range(STEPS))
        (summary,) = summaries[rank]
        first, last = summary["first_loss"], summary["last_loss"]
        assert first == pytest.approx(sum(losses[:AVERAGE_OVER]) / AVERAGE_OVER)
        assert last == pytest.approx(sum(losses[-AVERAGE_OVER:]) / AVERAGE_OVER)
        assert last < 0.75 * first, f"rank {rank}: the loss went from {first} to {last}"
    return {rank: summaries[rank][0] for rank in ranks}


def test_all_reduce_all_gather_and_broadcast_give_the_hand_computed_values(
    launches: dict[str, Launch],
) -> None:
    lines = launches["collectives"].lines()
    broadcast = torch.randn(4, generator=torch.Generator().manual_seed(1234)).tolist()
    expected = {
        "all_reduce": [1.0 + 2.0] * 3,  # ranks 0 and 1 add 1 and 2
        "all_gather": [[0, 0], [1, 10]],  # rank r gives [r, 10 r]
        "broadcast": broadcast,  # rank 0's numbers, on every rank
    }
    results = {(line["rank"], line["check"]): line["result"] for line in lines}
    assert results == {
        (rank, check): value for rank in range(RANKS) for check, value in expected.items()
    }


def test_ddp_lowers_the_loss_and_the_replicas_end_equal(launches: dict[str, Launch]) -> None:
    summaries = _check_training(launches["ddp"].lines(), ranks=[0, 1])
    assert summaries[0]["checksum"] == summaries[1]["checksum"]


def test_fsdp2_shards_the_weights_lowers_the_loss_and_learns_what_ddp_learns(
    launches: dict[str, Launch],
) -> None:
    summaries = _check_training(launches["fsdp2"].lines(), ranks=[0, 1])
    for summary in summaries.values():
        assert summary["numel"] == 64 * 32 + 32 + 32 * 10 + 10
        assert summary["local_numel"] == summary["numel"] // RANKS
    assert summaries[0]["checksum"] == summaries[1]["checksum"]
    (ddp, *_) = _check_training(launches["ddp"].lines(), ranks=[0, 1]).values()
    assert summaries[0]["checksum"] == pytest.approx(ddp["checksum"], rel=1e-5)


def test_a_two_stage_pipeline_lowers_the_loss_on_its_last_stage(
    launches: dict[str, Launch],
) -> None:
    lines = launches["pipeline"].lines()
    _check_training([line for line in lines if line["stage"] == 1], ranks=[1])
    assert [line for line in lines if line["stage"] == 0] == [
        {"rank": 0, "stage": 0, "steps": STEPS}
    ]
