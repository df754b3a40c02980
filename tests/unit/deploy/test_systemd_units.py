"""deploy/: the systemd unit and its drop-ins, installed the way docs/operations.md installs
them, pass ``systemd-analyze verify`` with nothing to say; the unit's command line is one the
``p2ptrain`` parser takes; and every sample config in deploy/config is one a node accepts.

``systemd-analyze verify`` needs no running systemd (it works in a container), but it checks
that ExecStart's executable exists: the units are rendered into a temporary directory with
``/opt/p2ptrain/venv/bin/p2ptrain`` replaced by this environment's ``p2ptrain``. It reads a
unit's drop-ins from ``NAME.service.d/`` beside the file it is given, and a link
``p2ptrain@NAME.service`` to the template is how it is given one instance by name.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from p2ptrain.cli.main import build_parser
from p2ptrain.cli.node_commands import _config, settings_from
from p2ptrain.errors import LocalError

if TYPE_CHECKING:
    from p2ptrain.node.setup import NodeSettings

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
UNITS = DEPLOY / "systemd"
TEMPLATE = "p2ptrain@.service"
#: Where docs/operations.md installs p2ptrain, as the unit names it.
INSTALLED = "/opt/p2ptrain/venv/bin/p2ptrain"
#: This environment's p2ptrain (the checkout's .venv/bin/p2ptrain under `make test`).
CHECKOUT = Path(sys.executable).with_name("p2ptrain")
#: A valid experiment id, standing in for the placeholder the samples hold.
EXPERIMENT = "ab" * 32

#: The instances checked, with their drop-ins: the trainer takes both (an open network, a GPU).
INSTANCES = {
    "seed": (),
    "validator": (),
    "trainer": ("open-network.conf", "gpu.conf"),
}


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is not on PATH (install systemd to check the unit)")
    if not CHECKOUT.is_file():
        pytest.skip(f"{CHECKOUT} does not exist: the project is not installed in this venv")
    return found


def _install(root: Path, instance: str, drop_ins: dict[str, str]) -> Path:
    """The template in ``root`` as in /etc/systemd/system, a link naming ``instance`` and
    its drop-ins (name: text) in ``p2ptrain@INSTANCE.service.d/``; the executable is this
    environment's. Returns the instance's path."""
    (root / TEMPLATE).write_text(_rendered((UNITS / TEMPLATE).read_text()))
    unit = root / f"p2ptrain@{instance}.service"
    unit.symlink_to(TEMPLATE)
    if drop_ins:
        directory = root / f"{unit.name}.d"
        directory.mkdir()
        for name, text in drop_ins.items():
            (directory / name).write_text(_rendered(text))
    return unit


def _rendered(text: str) -> str:
    assert INSTALLED in text or "ExecStart=" not in text, "the unit runs another p2ptrain"
    return text.replace(INSTALLED, str(CHECKOUT))


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_systemd_analyze(), "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("instance", sorted(INSTANCES))
def test_the_installed_unit_verifies_without_a_warning(tmp_path: Path, instance: str) -> None:
    drop_ins = {name: (UNITS / name).read_text() for name in INSTANCES[instance]}
    result = _verify(_install(tmp_path, instance, drop_ins))
    print(result.stdout, result.stderr)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_verify_reads_the_drop_ins_and_reports_what_it_ignores(tmp_path: Path) -> None:
    """The check above can fail: a key systemd does not know, in a drop-in, is reported."""
    unit = _install(tmp_path, "trainer", {"typo.conf": "[Service]\nRestartSecs=30s\n"})
    result = _verify(unit)
    assert "Unknown key 'RestartSecs'" in result.stderr


def _service_values(text: str, key: str) -> list[str]:
    """Every value of ``key=`` in a unit file's text, in order (no continuation lines)."""
    prefix = f"{key}="
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def test_the_command_line_is_one_the_parser_takes() -> None:
    (command,) = _service_values((UNITS / TEMPLATE).read_text(), "ExecStart")
    executable, *arguments = shlex.split(command)
    assert executable == INSTALLED
    # the specifiers and the variable as systemd fills them in for p2ptrain@validator
    filled = [
        word.replace("%i", "validator")
        .replace("${STATE_DIRECTORY}", "/var/lib/p2ptrain/validator")
        .replace("%d", "/run/credentials/p2ptrain@validator.service")
        for word in arguments
    ]
    args = build_parser(filled).parse_args(filled)
    assert (args.command, args.config, args.dir, args.secret_file) == (
        "node",
        "/etc/p2ptrain/validator.toml",
        "/var/lib/p2ptrain/validator",
        "/run/credentials/p2ptrain@validator.service/secret",
    )


def test_the_open_network_drop_in_is_the_template_without_the_secret() -> None:
    template = (UNITS / TEMPLATE).read_text()
    drop_in = (UNITS / "open-network.conf").read_text()
    (command,) = _service_values(template, "ExecStart")
    assert _service_values(drop_in, "LoadCredential") == [""]
    assert _service_values(drop_in, "ExecStart") == [
        "",
        command.replace(" --secret-file %d/secret", ""),
    ]
    assert "--secret-file" not in _service_values(drop_in, "ExecStart")[1]


def test_a_configuration_error_is_not_restarted() -> None:
    template = (UNITS / TEMPLATE).read_text()
    assert _service_values(template, "Restart") == ["on-failure"]
    # argparse exits 2 on a bad option, as p2ptrain does on a LocalError
    assert _service_values(template, "RestartPreventExitStatus") == [str(LocalError.exit_code)]


SAMPLES = sorted((DEPLOY / "config").glob("*.toml"))


def test_there_is_a_sample_config_per_role() -> None:
    assert [path.stem for path in SAMPLES] == ["seed", "trainer", "validator"]


def _settings(path: Path, data_dir: Path, *flags: str) -> NodeSettings:
    argv = ["node", "--config", str(path), "--dir", str(data_dir), *flags]
    return settings_from(build_parser(argv).parse_args(argv))


@pytest.mark.parametrize("path", SAMPLES, ids=[path.stem for path in SAMPLES])
def test_a_sample_config_is_one_the_node_accepts(path: Path, tmp_path: Path) -> None:
    raw = _config(str(path))  # refuses a key the node does not know
    assert "dir" not in raw and "secret_file" not in raw, "the unit gives these as flags"
    flags = ("--experiment", EXPERIMENT) if "experiment" in raw else ()
    settings = _settings(path, tmp_path / "node", *flags)
    assert settings.roles == (path.stem,)
    assert settings.data_dir == tmp_path / "node"
    if "experiment" in raw:
        # the placeholder stops the node, with a message, until the operator replaces it
        with pytest.raises(LocalError, match="is not 64 hex digits"):
            _settings(path, tmp_path / "node")
