"""Where quantkit keeps what it can recompute but would rather not: one folder per kind of entry.

``$QUANTKIT_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/quantkit``, else ``~/.cache/quantkit`` (where ``make install``
also keeps llama.cpp's tools and converter). An entry is only ever a speed-up: its key names everything that decides
its content, it is written whole or not at all (:func:`write_atomic`), and a missing or unreadable one is recomputed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def root() -> Path:
    """The cache's root folder (not created)."""
    if os.environ.get("QUANTKIT_CACHE_DIR"):
        return Path(os.environ["QUANTKIT_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "quantkit"


def folder(name: str) -> Path:
    """The folder of one kind of entry (``calibration``, ``sensitivity``, ...), created on first use."""
    path = root() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file, the whole new one, or none: a concurrent run
    or an interrupted one never leaves half an entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
