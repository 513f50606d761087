"""Permission bits that hold for the test's user, root included, so a test of an unreadable path can fail."""

from __future__ import annotations

import os
import shutil

import pytest


def without_dac() -> tuple[str, ...]:
    """A command prefix under which permission bits hold for this user: none for a user who is not root; for root,
    util-linux's ``setpriv`` dropping the two capabilities that let root pass them (root stays root, the owner of
    the test's files and of the interpreter's, so only the bits the test clears take effect)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root passes every permission bit, and setpriv (util-linux), which takes that away, is not here")
    caps = "-dac_override,-dac_read_search"
    return (setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}")
