"""The log of a command (:mod:`p2ptrain.cli.logs`): JSON records, the file and its
rotation, the options from flags and ``--config``, and a log file that cannot be written."""

from __future__ import annotations

import calendar
import io
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.cli.logs import JsonFormatter, LogOptions, install_handlers, log_options
from p2ptrain.cli.main import build_parser, main
from p2ptrain.errors import LocalError

#: 2026-11-28 13:05:01.123 UTC
CREATED = calendar.timegm((2026, 11, 28, 13, 5, 1)) + 0.123


def _record(exc_info: Any = None) -> logging.LogRecord:
    record = logging.LogRecord(
        "p2ptrain.net.node", logging.INFO, __file__, 1, "node %s up %s", ("ab12", "at x"), exc_info
    )
    record.created, record.msecs = CREATED, 123.0
    return record


def test_a_record_is_one_json_object() -> None:
    line = JsonFormatter().format(_record())
    assert json.loads(line) == {
        "time": "2026-11-28T13:05:01.123Z",
        "level": "INFO",
        "logger": "p2ptrain.net.node",
        "message": "node ab12 up at x",
        "pid": os.getpid(),
    }


def test_a_record_with_an_exception_carries_its_traceback_on_one_line() -> None:
    try:
        raise ValueError("shard 3 is short\nby 12 bytes")
    except ValueError:
        record = _record(sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "node ab12 up at x"
    assert entry["exception"].startswith("Traceback (most recent call last):\n")
    assert entry["exception"].endswith("ValueError: shard 3 is short\nby 12 bytes")


@pytest.fixture
def logger(request: pytest.FixtureRequest) -> Iterator[logging.Logger]:
    """A logger of the test's own, not the root (its records still reach pytest's handlers
    there); the handlers the test gave it closed at the end."""
    own = logging.getLogger(f"test-logs.{request.node.name}")
    yield own
    for handler in list(own.handlers):
        own.removeHandler(handler)
        handler.close()


def test_the_file_gets_info_stderr_warnings_and_the_file_is_rotated(
    tmp_path: Path, logger: logging.Logger
) -> None:
    path = tmp_path / "not-yet" / "node.log"  # its directory is created
    options = LogOptions(file=path, file_mb=300 / (1 << 20), file_keep=2)  # 300 bytes
    stderr = io.StringIO()
    install_handlers(options, logger, stderr)
    logger.debug("not kept anywhere")
    for window in range(12):
        logger.info("window %d certified: head %s", window, "ab" * 8)  # 150 bytes a line
    logger.warning("peer cd12 misbehaved")
    rotated = sorted(p.name for p in path.parent.iterdir())
    assert rotated == ["node.log", "node.log.1", "node.log.2"]  # two old files kept
    newest = path.read_text().splitlines()
    assert newest[-1].endswith(f" WARNING {logger.name}: peer cd12 misbehaved")
    kept = "".join((path.parent / n).read_text() for n in ("node.log.2", "node.log.1", "node.log"))
    assert "window 11 certified" in kept and "not kept anywhere" not in kept
    assert all(len(p.read_bytes()) <= 300 for p in path.parent.iterdir())
    (line,) = stderr.getvalue().splitlines()  # the warning only, in text as before
    assert line.endswith(" WARNING " + logger.name + ": peer cd12 misbehaved")


def test_the_file_is_appended_to(tmp_path: Path, logger: logging.Logger) -> None:
    path = tmp_path / "node.log"
    path.write_text("an earlier run\n")
    install_handlers(LogOptions(file=path), logger, io.StringIO())
    logger.info("this run")
    lines = path.read_text().splitlines()
    assert lines[0] == "an earlier run" and lines[1].endswith(": this run")


def test_json_goes_to_the_file_and_to_stderr_and_verbose_logs_debug(
    tmp_path: Path, logger: logging.Logger
) -> None:
    path = tmp_path / "node.log"
    stderr = io.StringIO()
    install_handlers(LogOptions(file=path, format="json", verbose=True), logger, stderr)
    logger.debug("asked %d peers", 3)
    in_file = [json.loads(line) for line in path.read_text().splitlines()]
    on_stderr = [json.loads(line) for line in stderr.getvalue().splitlines()]
    assert in_file == on_stderr
    assert [(e["level"], e["message"]) for e in in_file] == [("DEBUG", "asked 3 peers")]


def test_without_a_file_stderr_is_as_before(logger: logging.Logger) -> None:
    stderr = io.StringIO()
    (terminal,) = install_handlers(LogOptions(), logger, stderr)
    assert terminal.level == logging.WARNING
    assert logger.level == logging.WARNING
    logger.info("not shown")
    logger.error("shown")
    assert stderr.getvalue().endswith(f" ERROR {logger.name}: shown\n")
    assert not install_handlers(LogOptions(), logger, stderr)  # configured: left alone


@pytest.mark.parametrize("where", ["under-a-file", "a-directory"])
def test_a_log_file_that_cannot_be_written_is_a_clear_error(
    tmp_path: Path, where: str, logger: logging.Logger
) -> None:
    blocker = tmp_path / "blocker"
    if where == "under-a-file":
        blocker.write_text("")
        path = blocker / "node.log"
    else:
        blocker.mkdir()
        path = blocker
    with pytest.raises(LocalError, match=f"cannot write the log file {path}: .*give --log-file"):
        install_handlers(LogOptions(file=path), logger, io.StringIO())
    assert not logger.handlers  # nothing half set up


def test_a_node_command_with_an_unwritable_log_file_exits_with_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "blocker").write_text("")
    path = tmp_path / "blocker" / "node.log"
    assert main(["seed", "--dir", str(tmp_path / "d"), "--log-file", str(path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"p2ptrain: error: cannot write the log file {path}: ")


def test_the_options_and_their_defaults(tmp_path: Path) -> None:
    parser = build_parser(["seed"])
    assert log_options(parser.parse_args(["seed"])) == LogOptions()
    given = log_options(parser.parse_args(["-v", "seed", "--log-file", "n.log"]))
    assert (given.file, given.file_mb, given.file_keep, given.format) == (
        Path("n.log"),
        64,
        5,
        "text",
    )
    assert (given.file_threshold, given.stderr_threshold) == (logging.DEBUG, logging.DEBUG)
    assert LogOptions().file_threshold == logging.INFO and LogOptions().file_max_bytes == 64 << 20
    config = tmp_path / "node.toml"
    config.write_text('log_file = "a.log"\nlog_file_keep = 2\nlog_format = "json"\n')
    both = log_options(parser.parse_args(["seed", "--config", str(config), "--log-file-keep", "3"]))
    assert (both.file, both.file_keep, both.format) == (Path("a.log"), 3, "json")  # flags win
    with pytest.raises(LocalError, match="add --log-file PATH"):
        log_options(parser.parse_args(["seed", "--log-file-mb", "8"]))
    with pytest.raises(LocalError, match="--log-file-keep 0: keep 1 or more"):
        log_options(parser.parse_args(["seed", "--log-file", "n.log", "--log-file-keep", "0"]))
    with pytest.raises(LocalError, match=r"--log-file-mb 0\.0: give a size in MiB above 0"):
        log_options(parser.parse_args(["seed", "--log-file", "n.log", "--log-file-mb", "0"]))
    config.write_text('log_file = "a.log"\nlog_format = "xml"\n')
    with pytest.raises(LocalError, match="--log-format 'xml': use text or json"):
        log_options(parser.parse_args(["seed", "--config", str(config)]))
