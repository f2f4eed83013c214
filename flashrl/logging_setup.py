"""Per-process logging: everything at ``level`` to ``<run_dir>/logs/<process_name>.log``, WARNING+ to stderr.

    controller / engine-0 / trainer-rank1 ... --logging--> runs/<name>/logs/<process>.log  (level and up)
                                                      \\-> stderr                          (WARNING and up)

Each process calls ``setup_logging`` once at start (calling it again replaces what it installed, so
tests and re-runs do not stack handlers). The file is appended to, so a resumed run keeps its history.

The stderr handler looks ``sys.stderr`` up at each record instead of keeping the stream it saw at
start: the rich live dashboard swaps ``sys.stderr`` for a proxy that prints above the view, and a
handler holding the old stream would scribble over the dashboard.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]+$")
FORMAT = "%(asctime)s %(levelname)-7s {process}[%(process)d] %(name)s: %(message)s"


class _CurrentStderrHandler(logging.StreamHandler):
    """A StreamHandler writing to whatever ``sys.stderr`` is at emit time."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def _is_ours(handler: logging.Handler) -> bool:
    return getattr(handler, "_flashrl", False)


def setup_logging(run_dir: Path | None, process_name: str, level: str = "INFO") -> Path | None:
    """Configure the root logger of this process; returns the log file path (None without a run dir).

    ``process_name`` becomes the file name and the tag on every line (``controller``, ``engine-0``,
    ``trainer-rank1``); ``level`` is one of DEBUG, INFO, WARNING, ERROR (``run.log_level``).
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)} (run.log_level), got {level!r}")
    if not _NAME_OK.match(process_name):
        raise ValueError(
            f"process_name {process_name!r} is used as a log file name: use only letters, digits, '_', '.', '-'"
        )
    numeric = getattr(logging, level)
    fmt = logging.Formatter(FORMAT.format(process=process_name))
    root = logging.getLogger()
    for h in [h for h in root.handlers if _is_ours(h)]:
        root.removeHandler(h)
        h.close()

    err = _CurrentStderrHandler()
    err.setLevel(max(numeric, logging.WARNING))
    err.setFormatter(fmt)
    err._flashrl = True  # type: ignore[attr-defined]
    root.addHandler(err)

    path: Path | None = None
    if run_dir is not None:
        path = Path(run_dir) / "logs" / f"{process_name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(path, mode="a", encoding="utf-8")
        fh.setLevel(numeric)
        fh.setFormatter(fmt)
        fh._flashrl = True  # type: ignore[attr-defined]
        root.addHandler(fh)
    # Without a file, nothing below WARNING has anywhere to go; do not pay for formatting it.
    root.setLevel(numeric if path is not None else max(numeric, logging.WARNING))
    logging.captureWarnings(True)  # warnings.warn(...) from libraries land in the same file
    return path
