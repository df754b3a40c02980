"""Where a command's log goes: stderr, as always, and for a node command a file too.

Every command logs to stderr at WARNING (DEBUG under ``p2ptrain -v``), one line of text per
record, as ``logging.basicConfig`` would. A node command given ``--log-file PATH`` (or
``log_file`` in its ``--config``) also appends its log to PATH at INFO (DEBUG under ``-v``),
so that an operator who runs a node for days sees what it did without drowning stderr. The
file is rotated once it reaches ``--log-file-mb`` MiB, keeping ``--log-file-keep`` old files
(PATH.1 the newest, PATH.N the oldest).

``--log-format json`` writes every record as one JSON object per line, to the file and to
stderr, for journald and log shippers (:class:`JsonFormatter`).

Only the standard library, and :mod:`logging.handlers` only once a file is asked for:
``p2ptrain --version`` imports this module.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from p2ptrain.errors import LocalError

__all__ = [
    "CONFIG_KEYS",
    "JsonFormatter",
    "LogOptions",
    "add_log_arguments",
    "configure_logging",
    "install_handlers",
    "log_options",
]

#: The format of a text record, on stderr and in the file.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")
DEFAULT_FILE_MB = 64.0
DEFAULT_FILE_KEEP = 5
#: The log settings a node's ``--config`` file may hold: the flags' names with ``_``.
CONFIG_KEYS = frozenset({"log_file", "log_file_mb", "log_file_keep", "log_format"})
_MIB = 1 << 20


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line: ``time`` (ISO 8601 UTC with milliseconds,
    ``2026-11-28T13:05:01.123Z``), ``level``, ``logger``, ``message`` (formatted), ``pid``,
    and ``exception`` (the formatted traceback) and ``stack`` when the record has them."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _utc_time(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": os.getpid() if record.process is None else record.process,
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)  # cached, as logging does
        if record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)  # ASCII: any stderr encoding takes it


def _utc_time(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


@dataclass(frozen=True)
class LogOptions:
    """How a command logs. ``stderr_level`` is stderr's level without ``-v``."""

    verbose: bool = False
    stderr_level: int = logging.WARNING
    format: str = "text"
    #: The log file (None: stderr only).
    file: Path | None = None
    file_mb: float = DEFAULT_FILE_MB
    file_keep: int = DEFAULT_FILE_KEEP

    def __post_init__(self) -> None:
        if self.format not in LOG_FORMATS:
            raise LocalError(f"--log-format {self.format!r}: use text or json")
        mb = self.file_mb
        if isinstance(mb, bool) or not isinstance(mb, int | float) or not 0 < mb < math.inf:
            raise LocalError(f"--log-file-mb {mb!r}: give a size in MiB above 0 (default 64)")
        keep = self.file_keep
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise LocalError(
                f"--log-file-keep {keep!r}: keep 1 or more old files (default 5; with none "
                "the file would never be rotated)"
            )

    @property
    def stderr_threshold(self) -> int:
        return logging.DEBUG if self.verbose else self.stderr_level

    @property
    def file_threshold(self) -> int:
        return logging.DEBUG if self.verbose else logging.INFO

    @property
    def file_max_bytes(self) -> int:
        return max(1, int(self.file_mb * _MIB))

    def formatter(self) -> logging.Formatter:
        return JsonFormatter() if self.format == "json" else logging.Formatter(TEXT_FORMAT)


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """The log options of a node command (each may be in its ``--config`` too)."""
    parser.add_argument(
        "--log-file",
        metavar="PATH",
        help="also append the log to PATH (its directory created if missing): INFO and "
        "above, DEBUG with `p2ptrain -v`, while stderr shows warnings and errors as before",
    )
    parser.add_argument(
        "--log-file-mb",
        type=float,
        metavar="MIB",
        help=f"rotate the log file once it reaches this many MiB (default {DEFAULT_FILE_MB:g})",
    )
    parser.add_argument(
        "--log-file-keep",
        type=int,
        metavar="N",
        help="old log files kept when rotating: PATH.1 (the newest) to PATH.N "
        f"(default {DEFAULT_FILE_KEEP})",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help="text (default), or json: one JSON object per line (time, level, logger, "
        "message, pid, exception), in the file and on stderr",
    )


def log_options(args: argparse.Namespace) -> LogOptions:
    """The log settings of the command ``args`` runs: its flags, else those of its
    ``--config`` file (a command that has one sets ``read_config``, its reader), else the
    defaults."""
    read_config: Callable[[str | None], Mapping[str, Any]] | None = getattr(
        args, "read_config", None
    )
    config = {} if read_config is None else read_config(getattr(args, "config", None))

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return config.get(name) if value is None else value

    file, mb, keep = pick("log_file"), pick("log_file_mb"), pick("log_file_keep")
    if file is None and (mb is not None or keep is not None):
        raise LocalError(
            "--log-file-mb and --log-file-keep say how the log file is rotated: add "
            "--log-file PATH (or log_file in the config)"
        )
    if file is not None and (not isinstance(file, str) or not file):
        raise LocalError(f"--log-file {file!r}: give the path of a file (a string)")
    return LogOptions(
        verbose=bool(getattr(args, "verbose", False)),
        stderr_level=getattr(args, "log_level", logging.WARNING),
        format=pick("log_format") or "text",
        file=None if file is None else Path(file),
        file_mb=DEFAULT_FILE_MB if mb is None else mb,
        file_keep=DEFAULT_FILE_KEEP if keep is None else keep,
    )


def configure_logging(args: argparse.Namespace) -> None:
    """Set up the log of the command ``args`` runs (``main`` calls it first)."""
    install_handlers(log_options(args), logging.getLogger())


def install_handlers(
    options: LogOptions, logger: logging.Logger, stream: IO[str] | None = None
) -> list[logging.Handler]:
    """Give ``logger`` (the root logger, for a command) what ``options`` ask for, and return
    the handlers added: one for ``stream`` (stderr) unless it has handlers already (as
    ``logging.basicConfig``: a program or test that set up logging keeps its own), and one
    for the file, if any. Its level becomes the lowest of theirs."""
    formatter = options.formatter()
    added: list[logging.Handler] = []
    configured = bool(logger.handlers)
    if not configured:
        terminal = logging.StreamHandler(stream)
        terminal.setLevel(options.stderr_threshold)
        terminal.setFormatter(formatter)
        added.append(terminal)
    if options.file is not None:
        log_file = _file_handler(options.file, options)
        log_file.setFormatter(formatter)
        added.append(log_file)
    if not added:
        return added
    levels = [handler.level for handler in added]
    if configured:  # lowered, never raised: its own handlers still get what they got
        levels.append(logger.getEffectiveLevel())
    logger.setLevel(min(levels))
    for handler in added:
        logger.addHandler(handler)
    return added


def _file_handler(path: Path, options: LogOptions) -> logging.Handler:
    """A handler appending to ``path`` (its directory created), rotating it; a LocalError
    naming the path when it cannot be written."""
    from logging.handlers import RotatingFileHandler

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = RotatingFileHandler(
            path,
            maxBytes=options.file_max_bytes,
            backupCount=options.file_keep,
            encoding="utf-8",
        )
    except OSError as exc:
        where = "" if exc.filename in (None, str(path)) else f" ({exc.filename})"
        raise LocalError(
            f"cannot write the log file {path}: {exc.strerror or exc}{where}; give --log-file "
            "a file in a directory you may write to (or make it writable)"
        ) from exc
    handler.setLevel(options.file_threshold)
    return handler
