"""The quantization verbs, one per row of the formats registry that has a verb (``awq``, ``gptq``, ``fp8``,
``int8``, ``rtn``, ``gguf``).

Each verb is ``quantkit VERB MODEL OUTPUT [flags]`` or ``quantkit VERB --recipe FILE [flags]``. Its flags are the
registry row's (:mod:`quantkit.formats`): each one a recipe field, validated by the recipe schema, so a flag and a
recipe line are two spellings of one thing. This module only turns rows into Typer commands and renders results.
"""

from __future__ import annotations

import inspect as _inspect
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from quantkit import api, formats
from quantkit.cli.common import DRY_RUN_OPT, FORCE_OPT, JSON_OPT, RECIPE_OPT, command, emit_json, print_plan, reporter
from quantkit.errors import RecipeError, UsageError


def _option(flag: formats.Flag) -> Any:
    return typer.Option(None, *flag.decls, help=flag.help, rich_help_panel=flag.panel, show_default=False)


def _annotation(flag: formats.Flag) -> Any:
    return Optional[list[str]] if flag.type is list else Optional[flag.type]


def _quantize(row: formats.Format, values: dict[str, Any]) -> None:
    overrides: dict[str, Any] = {}
    for flag in row.flags:
        value = values.get(flag.name)
        if value is not None and value != []:
            overrides[f"{flag.field}|{flag.flag}"] = value
    model, output, recipe_path = values["model"], values["output"], values["recipe"]
    if model is not None:
        overrides["model.source|MODEL"] = model
    if output is not None:
        overrides["output|OUTPUT"] = output
    if recipe_path is None and (model is None or output is None):
        raise RecipeError(f"give MODEL and OUTPUT, or --recipe FILE (see `quantkit {row.verb} --help`)")
    r = api.load_recipe(recipe_path, overrides, base={"quantize": {"method": row.method}})
    if r.quantize is None or r.quantize.method != row.method:
        got = r.quantize.method if r.quantize else "multi-output"
        raise RecipeError(f"{recipe_path} is a {got} recipe, not {row.method}",
                          hint=f"use `quantkit {formats.by_method(got).verb if r.quantize else 'run'} "
                               f"--recipe {recipe_path}`")
    if values["dry_run"]:
        planned = api.plan(r, force=values["force"])
        print_plan(planned, values["json"])
        planned.check()  # exit 2 where the build would refuse (an existing output), after showing why
        return
    rep = reporter(values["json"])
    results = api.quantize(r, force=values["force"], reporter=rep)
    if values["json"]:
        emit_json([x.to_json() for x in results])
        return
    summary(rep.console, results)


def summary(console: Any, results: list[Any]) -> None:
    """The table every producing verb prints: artifact, format, scheme, size, compression, calibration, time."""
    t = Table(title="quantkit", title_justify="left")
    for col in ("artifact", "format", "quantization", "size", "vs source", "calibration", "time"):
        t.add_column(col)
    for r in results:
        m = r.manifest
        size, src = m.size_bytes, m.source.size_bytes
        calib = m.calibration
        t.add_row(str(r.path), m.kind, str(m.quantization.get("scheme", m.method)), api.fmt_bytes(size),
                  _versus(src, size),
                  f"{calib.samples}x{calib.seq_len} {calib.dataset}" if calib else "none",
                  f"{m.timings.get('total', 0):.1f}s")
    console.print(t)


def _versus(source: int | None, size: int | None) -> str:
    """The artifact's size against its source's, as a person says it: ``3.61x smaller``, or ``1.12x larger`` for an
    artifact that is bigger (a legacy layout beside the model, unquantized embeddings of a small model)."""
    if not source or not size:
        return "-"
    return f"{source / size:.2f}x smaller" if size <= source else f"{size / source:.2f}x larger"


def _help(row: formats.Format) -> str:
    examples = "\n\n".join(f"  [bold]$[/] {e}" for e in row.examples)
    return f"{row.help}\n\n[bold]Examples[/]\n\n{examples}" if examples else row.help


def _make_verb(row: formats.Format):  # noqa: ANN202 - builds a Typer command
    params = [
        _inspect.Parameter("model", _inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                           default=typer.Argument(None, help="Source checkpoint: a local folder or a hub id "
                                                  "(org/name).", show_default=False)),
        _inspect.Parameter("output", _inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                           default=typer.Argument(None, help="Output folder (written atomically; refused if it "
                                                  "exists, unless --force).", show_default=False)),
        _inspect.Parameter("recipe", _inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str], default=RECIPE_OPT),
        _inspect.Parameter("output_opt", _inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                           default=typer.Option(None, "--output", "-o", help="Output folder, as OUTPUT (for use "
                                                "with --recipe: overrides the recipe's output).",
                                                show_default=False)),
    ]
    for flag in row.flags:
        params.append(_inspect.Parameter(flag.name, _inspect.Parameter.KEYWORD_ONLY, annotation=_annotation(flag),
                                         default=_option(flag)))
    params += [
        _inspect.Parameter("force", _inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=FORCE_OPT),
        _inspect.Parameter("dry_run", _inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=DRY_RUN_OPT),
        _inspect.Parameter("json", _inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=JSON_OPT),
    ]

    def verb(**values: Any) -> None:
        given = {str(v) for v in (values.pop("output_opt"), values.get("output")) if v is not None}
        if len(given) > 1:
            raise UsageError(f"OUTPUT and --output name different folders ({', '.join(sorted(given))})",
                             hint="give the output once")
        values["output"] = given.pop() if given else None
        _quantize(row, values)

    verb.__signature__ = _inspect.Signature(params)  # type: ignore[attr-defined]
    verb.__name__ = row.verb or row.method
    verb.__doc__ = row.help
    return command(verb)


def register(app: typer.Typer) -> None:
    for row in formats.verbs():
        app.command(row.verb, help=_help(row), rich_help_panel="Quantize")(_make_verb(row))
