"""The CLI's exit (quantkit.cli.main._leave): it skips the interpreter's teardown, never what a normal exit owes.

Each case runs the real entry point in a fresh process with stdout on a pipe (block-buffered, so output left in
the buffer would be lost by an exit that forgot to flush it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import quantkit
from conftest import TINY
from conftest import quantkit as cli

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


def test_version_under_json_is_one_document() -> None:
    """``quantkit --json --version`` printed a line of text (--version was read before --json): it is one JSON
    document, in either order, with the backends' versions a manifest would record. With neither a command nor
    --version, the usage error stays."""
    for argv in (["--json", "--version"], ["--version", "--json"]):
        r = subprocess.run([sys.executable, "-m", "quantkit", *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        doc = _one_document(r.stdout)
        assert r.returncode == 0 and doc["quantkit"] == quantkit.__version__, argv
        assert doc["versions"]["quantkit"] == quantkit.__version__ and "torch" in doc["versions"], argv
    r = subprocess.run([sys.executable, "-m", "quantkit", "--json"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Missing command" in r.stderr and not r.stdout


def test_atexit_handlers_still_run() -> None:
    r = _run("import atexit; atexit.register(print, 'handler ran'); " + _main(["--version"]))
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "handler ran"


def test_waits_for_a_running_thread() -> None:
    thread = "threading.Thread(target=lambda: (time.sleep(0.5), print('thread done'))).start()"
    r = _run(f"import threading, time; {thread}; " + _main(["--version"]))
    assert r.returncode == 0 and "thread done" in r.stdout


def _one_document(stdout: str) -> object:
    """stdout holds exactly one JSON document (json.loads refuses trailing data)."""
    assert stdout.strip(), "nothing on stdout"
    return json.loads(stdout)


def test_json_error_exit_prints_one_document(tiny_rtn: Path, tmp_path: Path) -> None:
    """Under --json an error exit (1 or 2) printed nothing on stdout, so ``quantkit run R --json > run.json; jq -r
    .release run.json`` failed to parse: it now prints ``ok: false`` with the error, hint and exit code (the human
    line still on stderr); a verb that printed its document before failing prints no second one."""
    proc = cli("verify", tmp_path / "missing", "--json")
    doc = _one_document(proc.stdout)
    assert proc.returncode == 2 and doc == {"ok": False, "error": f"{tmp_path / 'missing'} does not exist",
                                            "hint": doc["hint"], "exit_code": 2} and doc["hint"]
    assert "error:" in proc.stderr

    proc = cli("--json", "eval", TINY, "--limit", "2")  # --json before the verb
    assert proc.returncode == 2 and _one_document(proc.stdout)["error"].startswith("--limit does not apply")

    tampered = tmp_path / "tampered"
    shutil.copytree(tiny_rtn, tampered)
    with open(tampered / "config.json", "a") as f:
        f.write(" ")
    proc = cli("verify", tampered, "--json")
    assert proc.returncode == 1 and "differ from their seal" in proc.stderr
    assert [r["ok"] for r in _one_document(proc.stdout)] == [False], "the results, not a second document"
