"""The commands that need no torch start without it.

``--version``, ``--help``, every ``COMMAND --help``, ``status`` (of a data directory, of an
address, ``--watch``), ``identity``, ``dashboard --dir``, ``experiment show`` and ``data
show`` each run in a fresh interpreter, which afterwards holds neither torch, transformers
nor the node's runtime. A command's subcommands' ``--help`` run after it in its interpreter,
each checked as it ends, so a module is blamed on the first command that brought it in.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.cli.commands import COMMANDS
from p2ptrain.cli.main import build_parser
from p2ptrain.core.envelope import seal
from p2ptrain.core.experiment_config import experiment_from_toml
from p2ptrain.core.identity import Identity
from p2ptrain.observe.status import Connections, LastWindow, NodeStatus, encode_status
from p2ptrain.store.keyfile import create_identity, load_identity

#: torch and transformers, and what runs a node, a workload, the simulator or a benchmark.
FORBIDDEN = (
    "torch",
    "transformers",
    "p2ptrain.aggregate",
    "p2ptrain.bench",
    "p2ptrain.net.node",
    "p2ptrain.node.launch",
    "p2ptrain.node.roles",
    "p2ptrain.driver.runner",
    "p2ptrain.node.setup",
    "p2ptrain.node.shell",
    "p2ptrain.node.trainer_api",
    "p2ptrain.sim.world",
    "p2ptrain.torch.registry",
    "p2ptrain.torch.workload",
)

#: Runs ``main`` once per argv (argv[2], JSON) and writes, for each, its exit code and the
#: forbidden packages and modules (argv[3]) loaded by then to argv[1]. A sleep is a Ctrl-C:
#: ``status --watch`` stops at its first wait.
RUNNER = """
import json, sys, time

def ctrl_c(seconds):
    raise KeyboardInterrupt

time.sleep = ctrl_c
from p2ptrain.cli.main import main

forbidden = tuple(json.loads(sys.argv[3]))
ran = []
for argv in json.loads(sys.argv[2]):
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    loaded = [f for f in forbidden if any(m == f or m.startswith(f + ".") for m in sys.modules)]
    ran.append({"argv": argv, "code": code, "loaded": loaded})
with open(sys.argv[1], "w") as report:
    json.dump(ran, report)
"""


@dataclass(frozen=True)
class Ran:
    code: int
    stdout: str
    stderr: str


#: What ``--version`` and ``--help`` must not import either: any command's module, and the
#: packages those bring (signatures, records).
NO_COMMAND = (
    *FORBIDDEN,
    *sorted({f"p2ptrain.cli.{command.module}" for command in COMMANDS.values()}),
    "cryptography",
    "msgspec",
)


def _command(
    report: Path, argvs: Sequence[Sequence[str]], forbidden: Sequence[str] = FORBIDDEN
) -> list[str]:
    return [
        sys.executable,
        "-c",
        RUNNER,
        str(report),
        json.dumps([list(argv) for argv in argvs]),
        json.dumps(list(forbidden)),
    ]


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "P2PTRAIN_DIR"}


def _checked(report: Path, stdout: str, stderr: str) -> list[dict[str, Any]]:
    assert report.exists(), f"the command did not finish:\n{stdout}\n{stderr}"
    ran: list[dict[str, Any]] = json.loads(report.read_text())
    for one in ran:
        assert one["loaded"] == [], f"p2ptrain {' '.join(one['argv'])} imported {one['loaded']}"
    return ran


def run_fresh(tmp_path: Path, *argvs: Sequence[str], forbidden: Sequence[str] = FORBIDDEN) -> Ran:
    """Each argv in turn in one fresh interpreter, which must not import ``forbidden``; the
    exit code of the last."""
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    completed = subprocess.run(
        _command(report, argvs, forbidden),
        capture_output=True,
        text=True,
        timeout=60,
        env=_environment(),
        check=False,
    )
    ran = _checked(report, completed.stdout, completed.stderr)
    return Ran(int(ran[-1]["code"]), completed.stdout, completed.stderr)


def _subcommands(parser: Any) -> dict[str, Any]:
    actions = getattr(parser, "_subparsers", None)
    if actions is None:
        return {}
    return {n: p for a in actions._group_actions for n, p in a.choices.items()}


def _help_runs() -> list[list[list[str]]]:
    """``COMMAND --help`` for every command, followed by its subcommands' (one level)."""
    runs = []
    for name, command in _subcommands(build_parser()).items():
        runs.append([[name, "--help"], *([name, sub, "--help"] for sub in _subcommands(command))])
    return runs


HELP_RUNS = _help_runs()


def test_version_and_help_import_no_command(tmp_path: Path) -> None:
    version = run_fresh(tmp_path, ["--version"], forbidden=NO_COMMAND)
    assert (version.code, version.stdout.split()[0]) == (0, "p2ptrain")
    shown = run_fresh(tmp_path, ["--help"], forbidden=NO_COMMAND)
    assert shown.code == 0
    assert shown.stdout == _help_of(build_parser())


def _help_of(parser: Any) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        parser.print_help()
    return out.getvalue()


def test_every_command_is_registered_with_its_module() -> None:
    """The registry names each command's module, and each module defines only its own."""
    defined = _subcommands(build_parser())
    assert list(defined) == list(COMMANDS)
    for name, command in COMMANDS.items():
        alone = _subcommands(build_parser([name]))
        assert alone[name].format_help() == defined[name].format_help(), name
        own = {n for n, c in COMMANDS.items() if c.module == command.module}
        complete = {n for n, p in alone.items() if p.format_help() == defined[n].format_help()}
        assert complete == own, f"{command.module} defines {sorted(complete)}"


@pytest.mark.parametrize("argvs", HELP_RUNS, ids=[run[0][0] for run in HELP_RUNS])
def test_every_command_help(tmp_path: Path, argvs: list[list[str]]) -> None:
    shown = run_fresh(tmp_path, *argvs)
    assert shown.code == 0
    assert shown.stdout.count("usage: p2ptrain ") == len(argvs)


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory with an identity and the status file a node wrote."""
    directory = tmp_path_factory.mktemp("node")
    identity = create_identity(directory)
    status = NodeStatus(
        peer_id=identity.peer_id,
        roles=("trainer",),
        address=None,
        experiment_id="e1" * 32,
        height=7,
        head_id="cd" * 32,
        adopted_head_id="cd" * 32,
        connections=Connections(outbound=2),
        last_window=LastWindow(
            height=7, head_id="cd" * 32, accepted=3, quarantined=0, reason="quorum", seconds=9.0
        ),
    )
    (directory / "status.json").write_bytes(encode_status(status))
    return directory


def test_status_of_a_data_directory(tmp_path: Path, node_dir: Path) -> None:
    shown = run_fresh(tmp_path, ["status", str(node_dir)])
    assert shown.code == 0
    assert f"height     7  head {'cd' * 8}" in shown.stdout.splitlines()
    as_json = run_fresh(tmp_path, ["status", str(node_dir), "--json"])
    assert json.loads(as_json.stdout)["height"] == 7


def test_status_watch_of_a_data_directory(tmp_path: Path, node_dir: Path) -> None:
    shown = run_fresh(tmp_path, ["status", str(node_dir), "--watch"])
    assert shown.code == 0
    assert re.search(rf"height +7  head {'cd' * 8}", shown.stdout), shown.stdout
    assert "waiting for" not in shown.stdout


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port  # closed again: nothing listens there


def test_status_of_an_address_nobody_listens_on_is_one_plain_line(tmp_path: Path) -> None:
    address = f"http://127.0.0.1:{_closed_port()}"
    shown = run_fresh(tmp_path, ["status", address])
    assert shown.code == 2
    (line,) = shown.stderr.splitlines()
    assert line.startswith(f"p2ptrain: error: cannot get the status of {address}: ")
    assert "connection refused" in line and "check the address" in line
    assert "Error(" not in line and "ConnectionKey" not in line


def test_identity(tmp_path: Path, node_dir: Path) -> None:
    shown = run_fresh(tmp_path, ["identity", "--dir", str(node_dir), "--json"])
    assert shown.code == 0
    assert json.loads(shown.stdout)["peer_id"] == load_identity(node_dir).peer_id


def test_experiment_show(tmp_path: Path) -> None:
    authority = Identity.generate()
    definition = (Path(__file__).parents[3] / "examples" / "experiment.toml").read_text()
    signed = seal(authority, experiment_from_toml(definition, authority.public_key))
    manifest = tmp_path / "exp.experiment"
    manifest.write_bytes(signed.envelope.encode())
    shown = run_fresh(tmp_path, ["experiment", "show", str(manifest)])
    assert shown.code == 0
    assert json.loads(shown.stdout)["experiment_id"] == signed.record_id


def test_data_show(tmp_path: Path) -> None:
    from p2ptrain.data.prepare import prepare_dataset

    source = tmp_path / "text.txt"
    source.write_text("to be or not to be, that is the question\n" * 8)
    prepared = prepare_dataset(source, tmp_path / "prepared", block_size=16)
    shown = run_fresh(tmp_path, ["data", "show", str(prepared.path), "--verify"])
    assert shown.code == 0
    assert f"{prepared.manifest.total_samples} samples" in shown.stdout


def test_dashboard_of_a_data_directory(tmp_path: Path, node_dir: Path) -> None:
    report = tmp_path / "report.json"
    argv = ["dashboard", "--dir", str(node_dir), "--listen", "127.0.0.1:0"]
    with subprocess.Popen(
        _command(report, [argv]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(),
    ) as dashboard:
        assert dashboard.stdout is not None
        first = dashboard.stdout.readline()  # printed once it listens (empty if it died)
        dashboard.send_signal(signal.SIGINT)
        stdout, stderr = dashboard.communicate(timeout=30)
    assert first.startswith(f"dashboard of {node_dir} at http://127.0.0.1:"), stderr
    (ran,) = _checked(report, first + stdout, stderr)
    assert ran["code"] == 0
