"""Drive a script in another Python environment and turn its JSON progress lines into Rich progress.

The script (``worker.py``) writes one JSON object per line on stdout: ``step`` (an opaque step: spinner),
``bar`` + ``advance`` (a counted step: progress bar), ``error``, and data events the caller keeps (``result``,
``versions``, ...). Everything else it prints goes to stderr, which is written to a log file in the work folder;
when the script fails, the error names the exception, quotes the end of that log and says where the whole log is
(the caller keeps the work folder of a failed run). Ctrl-C or SIGTERM stops the script too.
"""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from quantkit.errors import BackendError
from quantkit.progress import Reporter

WORKER = Path(__file__).resolve().parent / "worker.py"
LOG_TAIL_LINES = 15


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, for an error message."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


class _Display:
    """The one live Rich element (spinner or bar) for the current worker step; Rich allows one at a time."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.stack = ExitStack()
        self.task: Any = None

    def step(self, key: str, description: str) -> None:
        self.close()
        self.stack.enter_context(self.reporter.step(key, description))

    def bar(self, key: str, description: str, total: int) -> None:
        self.close()
        self.stack.enter_context(self.reporter.timed(key))
        self.task = self.stack.enter_context(self.reporter.bar(description, total, unit="batch"))

    def advance(self, n: float) -> None:
        if self.task is not None:
            self.task.advance(n)

    def close(self, failed: bool = False) -> None:
        """End the current element; a failed step is closed as failed, so it gets no check mark."""
        self.task = None
        if failed:
            err = RuntimeError("worker step failed")
            self.stack.__exit__(RuntimeError, err, None)
        else:
            self.stack.close()
        self.stack = ExitStack()


def run(python: str, config: dict[str, Any], workdir: Path, reporter: Reporter, *, args: tuple[str, ...] = (),
        what: str = "the ModelOpt step") -> dict[str, Any]:
    """Run the worker on ``config`` with ``python``; return its data events by name (``result``, ``versions``...)."""
    job = workdir / "job.json"
    job.write_text(json.dumps(config, indent=1))
    log = workdir / "worker.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    # OpenMP's default spin-waiting makes torch's many small CPU ops (fake quantization, AWQ's scale search) crawl
    # whenever the cores are shared: INT4 AWQ on the reference model took 30 s with it and 3 s without, 2 cores.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    events: dict[str, Any] = {}
    display = _Display(reporter)
    with open(log, "w") as err:
        proc = subprocess.Popen([python, str(WORKER), *args, "--config", str(job)], stdout=subprocess.PIPE,
                                stderr=err, stdin=subprocess.DEVNULL, text=True, env=env, cwd=workdir)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                kind = ev.pop("event", None)
                if kind == "step":
                    display.step(ev["key"], ev["description"])
                elif kind == "bar":
                    display.bar(ev["key"], ev["description"], ev["total"])
                elif kind == "advance":
                    display.advance(ev.get("n", 1))
                else:
                    if kind in ("result", "error"):
                        display.close(failed=kind == "error")
                    events[kind] = ev
            rc = proc.wait()
        except BaseException:
            display.close(failed=True)
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        display.close(failed=rc != 0)
    if rc != 0 or "error" in events or "result" not in events:
        e = events.get("error") or {}
        cause = f"{e.get('type')}: {e.get('message')}" if e else f"exit status {rc}, no result reported"
        tail = log_tail(log)
        quoted = f"\n--- end of its log ---\n{tail}" if tail else ""
        raise BackendError(f"{what} failed in {python}: {cause}{quoted}",
                           hint=f"the whole log (the libraries' own output) is kept in {log}")
    return events
