"""The ``quantkit`` application: global flags and the verbs, each registered from its own module."""

from __future__ import annotations

import os

import typer

from quantkit import __version__
from quantkit.cli import artifacts, evaluate, pipeline, quantize, recipes, smoke, trt
from quantkit.cli.common import STATE

HELP = """\
Turn Hugging Face checkpoints into verified quantized artifacts.

Every verb takes a recipe (--recipe FILE) and/or flags that override it, writes its output atomically with a
quantkit.json manifest (versions, recipe, calibration hash, timings, sha256 of every file), and prints a
summary table (or --json for pipelines).

Exit codes: 0 ok, 1 failure, 2 usage or recipe error, 3 a verification gate failed, 130 interrupted.
"""

app = typer.Typer(name="quantkit", help=HELP, no_args_is_help=True, rich_markup_mode="rich",
                  context_settings={"help_option_names": ["-h", "--help"]}, pretty_exceptions_enable=False)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only print errors and the final result."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    STATE.debug = debug
    STATE.quiet = quiet
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
    """Console-script entry point."""
    app()
