"""Where quantkit keeps what it can recompute but would rather not: one folder per kind of entry.

``$QUANTKIT_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/quantkit``, else ``~/.cache/quantkit`` (where ``make install``
also keeps llama.cpp's tools and converter). An entry is only ever a speed-up: its key names everything that decides
its content, it is written whole or not at all (:func:`write_atomic`), and a missing or unreadable one is recomputed.
Every entry is read through :func:`read`: the cache is a folder of the user's, so what lies at an entry's name may be
anything.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from quantkit.errors import IntegrityError
from quantkit.manifest import open_regular


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


def read(path: Path) -> bytes | None:
    """An entry's bytes, or None where there is none to use (missing, unreadable, a folder, or no regular file): the
    caller recomputes it, and the entry it writes then replaces a FIFO or a link there. Opened as quantkit opens a
    user's file (:func:`quantkit.manifest.open_regular`), because the cache lives in the user's folders
    (``~/.cache``): a FIFO put at an entry's name is passed over unopened, where a plain read waited for ever for a
    writer, and a device (a link to ``/dev/zero``) is never read without end."""
    try:
        with open_regular(path) as f:
            return f.read()
    except (OSError, IntegrityError):  # IntegrityError: a FIFO, a socket or a device, refused unopened
        return None


def read_json(path: Path) -> Any:
    """An entry's JSON, or None where there is none to use (:func:`read`) or it is no JSON (cut short, or written
    by something else): the caller recomputes it either way."""
    raw = read(path)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


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
