"""``smoke`` of an artifact whose quantkit.json is a FIFO: the artifact is refused in one line, exit 1, as ``verify``
and ``inspect`` refuse it, before any engine is looked for (quantkit.integrity.artifact_of found no artifact
there, so smoke went on to check vLLM in its Python and blamed the engine instead).

The process runs under a timeout: a reader that blocks on the FIFO fails here instead of hanging the suite; the
test never opens the FIFO itself."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import quantkit
from quantkit.manifest import MANIFEST

pytestmark = pytest.mark.cli

TIMEOUT = 60  # seconds: the refusal takes a few; a smoke waiting on the FIFO would wait for ever


def test_smoke_refuses_a_fifo_manifest_before_any_engine(tiny_rtn: Path, tmp_path: Path) -> None:
    """``quantkit smoke ART`` (its engine found from the files: vLLM for this compressed-tensors artifact) with
    ART/quantkit.json a named pipe no one writes."""
    art = tmp_path / "art"
    shutil.copytree(tiny_rtn, art)
    (art / MANIFEST).unlink()
    os.mkfifo(art / MANIFEST)
    try:
        proc = quantkit("smoke", art, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"quantkit smoke {art} was still running after {TIMEOUT} s: it waited on a FIFO")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in said, said[-2000:]
    assert proc.stderr.splitlines()[0] == f"error: {art / MANIFEST} is a FIFO, not a file: reading it would never " \
                                          "end", said[-2000:]
    assert proc.stdout == "" and "vllm" not in said.lower() and "Checking" not in said, said[-2000:]
