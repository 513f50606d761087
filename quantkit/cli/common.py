"""What every verb shares: global flags, error handling, JSON vs human output, signal handling.

Human output goes to stdout normally and to stderr under ``--json``, so stdout then carries exactly one JSON
document. User errors print one message (and a hint) with their documented exit code; ``--debug`` re-raises
them with the traceback.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from typer.models import ArgumentInfo, ParameterInfo
from rich.console import Console
from rich.markup import escape

from quantkit import interrupts
from quantkit.errors import EXIT_INTERRUPTED, QuantkitError, path_error
from quantkit.progress import Reporter, fmt_bytes, silence_library_bars, use


class State:
    """Global flags from the top-level callback."""

    debug: bool = False
    quiet: bool = False
    json: bool = False
    emitted: bool = False  # the verb printed its JSON document (a gate failure raises after it)


STATE = State()
F = TypeVar("F", bound=Callable[..., Any])

JSON_OPT = typer.Option(False, "--json", help="Print one machine-readable JSON document on stdout (human output goes to stderr).")
FORCE_OPT = typer.Option(False, "--force", "-f", help="Replace an existing output that quantkit wrote (or an empty "
                         "folder), only once the new one is complete.")
RECIPE_OPT = typer.Option(None, "--recipe", "-r", help="Recipe YAML file (or a shipped recipe's name); flags override its fields.")
QUIET_OPT = typer.Option(False, "--quiet", "-q", help="Only print errors and the final result.", rich_help_panel="Output")
DEBUG_OPT = typer.Option(False, "--debug", help="Show full tracebacks for errors.", rich_help_panel="Output")


def console(as_json: bool) -> Console:
    """Human output; logs and CI captures (no terminal) get 160 columns so summary tables stay readable."""
    stream = sys.stderr if as_json else sys.stdout
    return Console(stderr=as_json, highlight=False, width=None if stream.isatty() else 160)


def reporter(as_json: bool) -> Reporter:
    """The command's reporter, also the one its engines' waits report through (:func:`quantkit.progress.use`)."""
    return use(Reporter(console(as_json), quiet=STATE.quiet))


DRY_RUN_OPT = typer.Option(False, "--dry-run", help="Check everything and print the plan (outputs, calibration, "
                           "free disk needed and peak memory, what would be skipped and why) without loading weights.")


def print_plan(plan: Any, as_json: bool) -> None:
    """The ``--dry-run`` table (or its JSON)."""
    from rich.table import Table

    if as_json:
        emit_json(plan.to_json())
        return
    c = console(False)
    s = plan.source
    c.print(f"[bold]plan[/] for {escape(s['id'])} ({s['architecture']}, {s['parameters']:,} parameters, "
            f"{fmt_bytes(s['size_bytes'])}); nothing was loaded or written")
    t = Table(title_justify="left")
    for col in ("output", "format", "action", "calibration", "free disk", "host RAM", "GPU", "evaluate", "smoke"):
        t.add_column(col, overflow="fold")
    for o in plan.outputs:
        t.add_row(escape(o.path), o.format, f"{o.action}: {escape(o.why)}", escape(o.calibration),
                  fmt_bytes(o.disk_bytes), fmt_bytes(o.host_bytes), fmt_bytes(o.gpu_bytes) if o.gpu_bytes else "-",
                  escape(o.evaluate), escape(o.smoke))
    c.print(t)
    for note in plan.notes:
        c.print(escape(note))
    for o in plan.outputs:
        for note in o.notes:
            c.print(f"[yellow]note:[/] {escape(o.path)}: {escape(note)}")
    c.print("[dim]free disk: what must be free while it is made (the free-space check's figure; a GGUF output's "
            "includes its 16-bit intermediate), not the artifact's size; memory: rules of thumb (quantkit.plan)[/]")


def emit_json(data: Any) -> None:
    """The verb's one JSON document on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()
    STATE.emitted = True


def _emit_failure(as_json: bool, message: str, hint: str | None, exit_code: int) -> None:
    """Under ``--json``, a verb that ends on an error still prints its one JSON document, unless it printed one
    before failing (a gate failure, exit 3, prints the report first): an empty stdout left ``quantkit run R --json >
    run.json; jq -r .release run.json`` failing with a parse error instead of reading ``ok: false``."""
    if as_json and not STATE.emitted:
        emit_json({"ok": False, "error": message, "hint": hint, "exit_code": exit_code})


def handle_errors(fn: F) -> F:
    """Turn QuantkitError (and a name too long for the filesystem), Ctrl-C and SIGTERM into one readable message and
    the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        interrupts.install()
        err = Console(stderr=True, highlight=False)
        as_json = bool(kwargs.get("json")) or STATE.json
        STATE.emitted = False

        def fail(e: QuantkitError) -> typer.Exit:
            err.print(f"[bold red]error:[/] {escape(e.message)}", soft_wrap=True)
            if e.hint:
                err.print(f"  [dim]hint:[/] {escape(e.hint)}", soft_wrap=True)
            _emit_failure(as_json, e.message, e.hint, e.exit_code)
            return typer.Exit(e.exit_code)

        try:
            return fn(*args, **kwargs)
        except QuantkitError as e:
            if e.exit_code == EXIT_INTERRUPTED:
                interrupts.settle()
            if STATE.debug:
                raise
            raise fail(e) from None
        except OSError as e:  # a name too long, or a path this user may not use: met by whichever check looks first
            usage = path_error(e)
            if usage is None or STATE.debug:
                raise
            raise fail(usage) from None
        except KeyboardInterrupt as e:
            interrupts.settle()
            if STATE.debug:
                raise
            why = str(e) or "stopped by SIGINT"
            err.print(f"[bold red]interrupted[/] ({escape(why)}): temporary files were removed", soft_wrap=True)
            _emit_failure(as_json, f"interrupted ({why}): temporary files were removed", None, EXIT_INTERRUPTED)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper  # type: ignore[return-value]


def _not_empty(convert: Callable[[str], Any], what: str) -> Callable[[Any], Any]:
    """A parser that refuses an empty string (exit 2), then converts. Typer turns an empty path into ``Path(".")``,
    so ``quantkit verify "$RELEASE"`` with the variable empty (``jq -r .release`` of a failed run) checked the current
    folder and passed; an empty ``--baseline "$BASE"`` fell back to the manifest's source and ``--calib ""`` read the
    current folder as a text file."""
    def parse(value: Any) -> Any:
        if not isinstance(value, str):  # a default, already typed
            return value
        if not value.strip():
            raise typer.BadParameter(f"an empty {what} (an unset variable?)")
        return convert(value)

    return parse


def _refuse_empty_values(fn: Callable[..., Any], sig: inspect.Signature) -> None:
    """Give every text parameter the :func:`_not_empty` parser: those typed ``Path`` or ``str`` (alone, in a list or
    optional) and every positional argument (each verb's are paths, models, recipes or sets by name). No option of
    quantkit's means anything when empty: each names a model, a file, an engine, a prompt or a choice."""
    hints = typing.get_type_hints(fn) if any(isinstance(p.annotation, str) for p in sig.parameters.values()) else {}
    for p in sig.parameters.values():
        info = p.default
        if not isinstance(info, ParameterInfo) or info.parser is not None or getattr(info, "click_type", None):
            continue
        hint = hints.get(p.name, p.annotation)
        if _is(hint, Path):
            info.parser = _not_empty(Path, "path names no file or folder")
        elif isinstance(info, ArgumentInfo):
            info.parser = _not_empty(str, "path names no file or folder")
        elif _is(hint, str):
            info.parser = _not_empty(str, "value names nothing")


def _is(hint: Any, kind: type) -> bool:
    """``kind``, or a list or an optional of it."""
    return hint is kind or any(_is(a, kind) for a in typing.get_args(hint))


def command(fn: F) -> F:
    """A verb: :func:`handle_errors`, plus the global ``--json``, ``--quiet`` and ``--debug`` accepted before the
    verb as well as after it (``quantkit gptq MODEL OUT --quiet`` and ``quantkit --quiet gptq MODEL OUT`` are the
    same), and an empty value refused (:func:`_refuse_empty_values`)."""
    handled = handle_errors(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, quiet: bool = False, debug: bool = False, **kwargs: Any) -> Any:
        STATE.quiet = STATE.quiet or quiet
        STATE.debug = STATE.debug or debug
        if "json" in kwargs:  # every verb takes --json; given before the verb, the top-level callback has it
            kwargs["json"] = kwargs["json"] or STATE.json
        if not STATE.debug:
            silence_library_bars()  # libraries' own bars ignore --quiet and break Rich's display
        return handled(*args, **kwargs)

    sig = inspect.signature(fn)
    _refuse_empty_values(fn, sig)
    extra = [inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=QUIET_OPT),
             inspect.Parameter("debug", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=DEBUG_OPT)]
    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
