"""The sha256 of files quantkit reads but does not write (a source checkpoint's weights), each hashed once per
version of the file.

``quantkit run`` reuses an artifact only when it was made from the same source, and the baseline's task scores and
the bits target's sensitivity measurement are cached per source. ``config.json`` alone cannot say so: a fine-tuned
or re-exported checkpoint of the same architecture keeps its config, and an artifact of the old weights would be
shipped with its old "pass". Only every byte can say so, and hashing every byte costs (16 GB for an 8B model, 140 GB
for a 70B). So a file's hash is kept in the cache (:mod:`quantkit.cache`, ``file-sha256/``) under the file's
identity on disk: its resolved path, device, inode, size, and modification and change times in ns (the test git's
index and :class:`quantkit.seal.Sealer` make). A file rewritten, copied or replaced has another identity and is
hashed again; an untouched one costs a ``stat``. The change time is there because a tool may restore a
modification time after editing a file (``touch -d``, ``cp -p`` onto an existing file), but nothing sets it back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from quantkit import cache
from quantkit.seal import hash_many

FOLDER = "file-sha256"


def _identity(path: Path) -> str:
    """The cache entry's name: the sha256 of where the file is and the stat fields that change when it does."""
    real = path.resolve()
    st = os.stat(real)
    fields = [str(real), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def sha256s(paths: list[Path]) -> dict[Path, str]:
    """Each file's sha256: from the cache where the file is the version that was hashed, else hashed now (several
    files at once, :func:`quantkit.seal.hash_many`) and kept."""
    folder = cache.folder(FOLDER)
    known: dict[Path, str] = {}
    todo: dict[Path, str] = {}
    for p in paths:
        name = _identity(p)
        kept = (cache.read(folder / name) or b"").decode(errors="replace").strip()  # a FIFO or a device: none
        if len(kept) == 64 and all(c in "0123456789abcdef" for c in kept):
            known[p] = kept
        else:
            todo[p] = name
    for p, digest in hash_many(list(todo)):
        if _identity(p) == todo[p]:  # unchanged while it was read: the hash is that version's
            cache.write_atomic(folder / todo[p], digest.encode())
        known[p] = digest
    return known


def digest(paths: list[Path], root: Path) -> str:
    """One sha256 for a set of files: over each file's path under ``root`` and its sha256, in path order. Files that
    move together under another root (a copied checkpoint) give the same digest."""
    lines = sorted(f"{p.relative_to(root).as_posix()}\t{h}\n" for p, h in sha256s(paths).items())
    return hashlib.sha256("".join(lines).encode()).hexdigest()
