"""The ``quantkit`` application: global flags and the verbs, each registered from its own module."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

import typer

from quantkit import __version__, api
from quantkit.cli import artifacts, evaluate, pipeline, quantize, recipes, smoke, trt
from quantkit.cli.common import JSON_OPT, STATE, emit_json

HELP = """\
Turn Hugging Face checkpoints into verified quantized artifacts.

Every verb takes a recipe (--recipe FILE) and/or flags that override it, writes its output atomically with a
quantkit.json manifest (versions, recipe, calibration hash, timings, sha256 of every file), and prints a
summary table (or --json for pipelines).

Exit codes: 0 ok, 1 failure, 2 usage or recipe error, 3 a verification gate failed, 130 interrupted.
"""

app = typer.Typer(name="quantkit", help=HELP, no_args_is_help=True, rich_markup_mode="rich",
                  context_settings={"help_option_names": ["-h", "--help"]}, pretty_exceptions_enable=False)


def _print_version(as_json: bool) -> None:
    """``quantkit --version``: a line, or under ``--json`` one document with the backends' versions as a manifest
    records them, so a pipeline can log what it runs with before it runs."""
    if as_json:
        emit_json({"quantkit": __version__, "versions": api.installed_versions()})
    else:
        typer.echo(f"quantkit {__version__}")


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only print errors and the final result."),
    json: bool = JSON_OPT,
    version: bool = typer.Option(False, "--version", help="Print the version (with --json: every backend's too)."),
) -> None:
    # --version is read here rather than by an eager callback, which runs before --json is parsed: `quantkit
    # --json --version` then printed a line of text where a pipeline expected JSON. Invoked without a command so
    # that `quantkit --version` alone gets here; with neither, Click's own usage error (exit 2) is kept.
    STATE.debug = debug
    STATE.quiet = quiet
    STATE.json = json
    if version:
        _print_version(json)
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        ctx.fail("Missing command.")
    if not debug:
        # Backends draw their own tqdm bars per layer; quantkit's Rich bars and step timings replace them.
        os.environ.setdefault("TQDM_DISABLE", "1")


quantize.register(app)
trt.register(app)
recipes.register(app)
artifacts.register(app)
evaluate.register(app)
smoke.register(app)
pipeline.register(app)


def main() -> None:
    """Console-script entry point (``quantkit`` and ``python -m quantkit``)."""
    try:
        app()
    except SystemExit as e:
        _leave(e.code)


def _leave(code: object) -> NoReturn:
    """End the process with ``code`` without tearing the interpreter down, once nothing is left to wait for.

    Why: after a quantize run, Python's own finalization clears the thousands of modules torch, transformers and
    llm-compressor loaded and garbage-collects them, which cost 1.3 s of CPU (2.8 s wall on a loaded machine) after
    the 135M model's run had finished (bench/results/fixed_cost.md). Everything quantkit writes is complete before
    this: an artifact is hashed, fsynced and renamed into place inside the command, and its caches are written
    atomically. What a normal exit would still do is done here: the ``atexit`` handlers run (logging's flush,
    temporary folders, worker pools), then stdout and stderr are flushed (exit 120 if they cannot be, as Python
    does). Where a non-daemon thread is still running, the ordinary exit waits for it instead.
    """
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if others:
        raise SystemExit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # SystemExit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        status = status or 120
    os._exit(status)
