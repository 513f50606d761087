"""``recipes`` (list and show the shipped recipes) and ``calib`` (list and preview calibration sets)."""

from __future__ import annotations

from typing import Any, Optional

import typer
import yaml
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

from quantkit import api
from quantkit.cli.common import JSON_OPT, command, console, emit_json


@command
def recipes_cmd(
    name: Optional[str] = typer.Argument(None, help="Show this recipe (name or path), validated, every field with "
                                         "its default filled in (null where unset)."),
    schema: bool = typer.Option(False, "--schema", help="Print the recipe JSON schema (every field)."),
    json: bool = JSON_OPT,
) -> None:
    """List the shipped recipes in recipes/, or show one: validated, every field with its default filled in, null
    where it is unset (as --json shows it).

    [bold]Examples[/]

      [bold]$[/] quantkit recipes

      [bold]$[/] quantkit recipes awq

      [bold]$[/] quantkit recipes --schema"""
    c = console(json)
    if schema:
        emit_json(api.recipe_schema())
        return
    if name:
        path, r = api.show_recipe(name)
        if json:
            emit_json(r.model_dump(mode="json"))
        else:
            c.print(f"[bold]{path}[/] (valid; defaults filled in)")
            c.print(Syntax(_every_field(r), "yaml"))
        return
    rows = api.shipped_recipes()
    if json:
        emit_json(rows)
        return
    t = Table(title="shipped recipes (quantkit recipes NAME shows one)", title_justify="left")
    t.add_column("name", style="bold")
    t.add_column("description")
    for r in rows:
        t.add_row(r["name"], r["description"])
    c.print(t)


def _every_field(recipe: Any) -> str:
    """The recipe as YAML with every field, a null one too. Not recipe.dump, the manifest's recipe_yaml, which leaves
    out a field whose default is null (``group_size``, ``target_bits``, ``model.revision``): shown that way, a user
    looking for the whole schema of a recipe never learnt those fields exist. Read back, it is the same recipe."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


calib_app = typer.Typer(help="Calibration sets: list the shipped ones, preview any source.\n\n[bold]Examples[/]\n\n"
                        "  [bold]$[/] quantkit calib list\n\n"
                        "  [bold]$[/] quantkit calib show code --model models/quantkit-tiny --samples 16 --seq-len 256",
                        no_args_is_help=True)


@calib_app.command("list")
@command
def calib_list(json: bool = JSON_OPT) -> None:
    """List the calibration and evaluation sets shipped in calibration/.

    [bold]Examples[/]

      [bold]$[/] quantkit calib list"""
    rows = api.calibration_sets()
    if json:
        emit_json(rows)
        return
    t = Table(title="shipped sets (calibration/; PSF licence, see LICENSE-PSF.txt)", title_justify="left")
    for col in ("name", "documents", "characters"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], str(r["documents"]), f"{r['characters']:,}")
    # escaped: Rich markup takes "[@split]" for a tag and prints nothing of it
    t.add_row("hub", "-", escape("wikitext2, pile-val, c4, ultrachat, org/name[:config][@split] (needs the hub)"))
    console(False).print(t)


@calib_app.command("show")
@command
def calib_show(
    source: str = typer.Argument(..., help="Shipped set name, file, or hub dataset."),
    model: Optional[str] = typer.Option(None, "--model", help="Tokenize with this model's tokenizer and report the token hash."),
    samples: int = typer.Option(8, "--samples", help="Samples to build when --model is given."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per sample when --model is given."),
    seed: int = typer.Option(0, "--seed"),
    field: str = typer.Option("text", "--field", help="Text field for JSON/parquet sources."),
    chat_template: Optional[bool] = typer.Option(
        None, "--chat-template/--no-chat-template",
        help="Render samples with the model's chat template \\[default: auto, as the quantize verbs: for an instruct "
             "model, whose EOS ends the template's turns]."),
    n: int = typer.Option(3, "--show", help="Documents to preview."),
    json: bool = JSON_OPT,
) -> None:
    """Preview a calibration source: its documents, and with --model the exact token samples and their sha256.

    [bold]Examples[/]

      [bold]$[/] quantkit calib show prose --show 1

      [bold]$[/] quantkit calib show mixed --model models/quantkit-tiny --samples 16 --seq-len 256"""
    info = api.preview_calibration(source, model=model, samples=samples, seq_len=seq_len, seed=seed, field=field,
                                   chat_template=chat_template, show=n)
    if json:
        emit_json(info)
        return
    c = console(False)
    n = info["documents"]
    c.print(f"[bold]{escape(source)}[/] ({info['kind']}): {n} document{'s' * (n != 1)}"  # a name may hold "[...]"
            + (" (chat)" if info["chat"] else "")
            + (f", sha256 {info['source_sha256'][:16]}…" if info["source_sha256"] else ""))
    if info["repeated"]:
        c.print(f"[yellow]{info['repeated']:,} of {n:,} documents repeat an earlier one[/] (used as they are, so "
                "each weighs more)")
    for i, p in enumerate(info["preview"]):
        c.rule(f"document {i}")
        c.print(p, markup=False)
    if model:
        cal = info["calibration"]
        c.rule("tokens")
        c.print(f"{cal['samples']} samples x {cal['seq_len']} tokens = {cal['tokens']} tokens, "
                f"sha256 {cal['tokens_sha256']}")


def register(app: typer.Typer) -> None:
    app.command("recipes", rich_help_panel="Recipes and data")(recipes_cmd)
    app.add_typer(calib_app, name="calib", rich_help_panel="Recipes and data")
