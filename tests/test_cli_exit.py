"""The CLI's exit (quantkit.cli.main._leave): it skips the interpreter's teardown, never what a normal exit owes.

Each case runs the real entry point in a fresh process with stdout on a pipe (block-buffered, so output left in
the buffer would be lost by an exit that forgot to flush it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import quantkit

pytestmark = pytest.mark.cli

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _main(argv: list[str]) -> str:
    return f"import sys; from quantkit.cli.main import main; sys.argv = {['quantkit', *argv]!r}; main()"


def test_output_flushed_and_exit_code_kept() -> None:
    ok = subprocess.run([sys.executable, "-m", "quantkit", "--version"], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
    assert (ok.returncode, ok.stdout.strip()) == (0, f"quantkit {quantkit.__version__}")
    usage = subprocess.run([sys.executable, "-m", "quantkit", "gptq"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert usage.returncode == 2 and "give MODEL and OUTPUT" in usage.stderr


def test_atexit_handlers_still_run() -> None:
    r = _run("import atexit; atexit.register(print, 'handler ran'); " + _main(["--version"]))
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "handler ran"


def test_waits_for_a_running_thread() -> None:
    thread = "threading.Thread(target=lambda: (time.sleep(0.5), print('thread done'))).start()"
    r = _run(f"import threading, time; {thread}; " + _main(["--version"]))
    assert r.returncode == 0 and "thread done" in r.stdout
