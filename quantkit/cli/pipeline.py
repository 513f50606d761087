"""``run`` (a whole recipe: quantize, evaluate, smoke-test, bundle) and ``publish`` (upload to the hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from quantkit import api, pipeline
from quantkit.cli.common import DRY_RUN_OPT, FORCE_OPT, JSON_OPT, command, emit_json, print_plan, reporter


@command
def run_cmd(
    recipe: str = typer.Argument(..., help="Recipe YAML file, or a shipped recipe's name (quantkit recipes)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Release folder (overrides the recipe's output)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Source model (overrides model.source)."),
    no_eval: bool = typer.Option(False, "--no-eval", help="Skip evaluation (reported as skipped)."),
    no_smoke: bool = typer.Option(False, "--no-smoke", help="Skip smoke tests (reported as skipped)."),
    force: bool = FORCE_OPT,
    dry_run: bool = DRY_RUN_OPT,
    json: bool = JSON_OPT,
) -> None:
    """Run a recipe end to end: produce every output (reusing complete ones), evaluate them against the source,
    smoke-test each in its engine where available, check the gates, and write the release bundle (SHA256SUMS,
    report.md, report.json, plot, a model card per artifact).

    Exit codes: 0 release ok, 1 a step failed, 2 recipe/usage error (or another run holds the release), 3 a
    verification gate failed, 130 interrupted.

    [bold]Examples[/]

      [bold]$[/] quantkit run recipes/demo.yaml --dry-run

      [bold]$[/] quantkit run demo

      [bold]$[/] quantkit run recipes/fp8-dynamic.yaml --no-smoke -o out/rel-fp8 --json > run.json"""
    r = api.load_recipe(recipe, {"output|--output": str(output) if output else None, "model.source|--model": model})
    if dry_run:
        planned = api.plan(r, force=force, pipeline=True, evaluate=not no_eval, smoke=not no_smoke)
        print_plan(planned, json)
        planned.check()  # exit 2 where the run would refuse, once the plan is shown
        return
    rep = reporter(json)
    result = pipeline.run(r, force=force, reporter=rep, evaluate=not no_eval, smoke=not no_smoke)
    if json:
        emit_json(result.to_json())
    else:
        summary(rep.console, result)
    result.check()


def summary(console: Any, result: Any) -> None:
    """The release table: one row per artifact file (a GGUF output has one per type)."""
    t = Table(title=f"release {result.release}", title_justify="left")
    for col in ("output", "status", "format", "size", "ppl", "ppl ratio", "KLD", "top-1", "smoke", "gates"):
        t.add_column(col)
    for o in result.outputs:
        j = o.to_json()
        ev = o.evaluation or {}
        rows = ev.get("results") or [ev]
        for x in rows:
            gates = [g for g in o.gates if g.get("file") in (None, x.get("file"))]
            unchecked = len((ev.get("tasks_skipped") or {}).get("gates_not_checked") or [])
            gate_s = "-" if not gates else ("[green]pass[/]" if all(g["passed"] for g in gates) else "[red]FAIL[/]")
            if unchecked:
                gate_s = ("" if not gates else gate_s + ", ") + f"[yellow]{unchecked} not checked[/]"
            t.add_row(o.name + (f" {x['file']}" if x.get("file") else ""), o.status, j["kind"] or "-",
                      api.fmt_bytes(x.get("size_bytes") or j["size_bytes"] or 0),
                      api.fmt_num(x.get("ppl")), api.fmt_num(x.get("ppl_ratio")), api.fmt_num(x.get("kld"), 4),
                      api.fmt_num(x.get("top1")), o.smoke_status(x.get("file")), gate_s)
    console.print(t)
    console.print(f"[dim]{result.seconds:.1f}s; bundle in {result.release} ({', '.join(result.bundle)})[/]")


@command
def publish_cmd(
    folder: Path = typer.Argument(..., help="An artifact folder, or a release folder of artifacts."),
    repo: str = typer.Option(..., "--repo", help="Hub repository ORG/NAME (a release gets ORG/NAME-<artifact> each)."),
    private: bool = typer.Option(False, "--private", help="Create the repositories as private."),
    json: bool = JSON_OPT,
) -> None:
    """Upload artifacts to the Hugging Face hub with huggingface_hub, after re-verifying every sha256 (and, for a
    release, its SHA256SUMS and verdict: a release whose report.json says it failed is refused).

    [bold]Examples[/]

      [bold]$[/] quantkit publish out/demo --repo my-org/quantkit-tiny --private

      [bold]$[/] quantkit publish out/awq --repo my-org/quantkit-tiny-awq"""
    done = api.publish(folder, repo, private=private)
    if json:
        emit_json(done)
    else:
        for d in done:
            typer.echo(f"uploaded {d['path']} -> {d['url']}")


def register(app: typer.Typer) -> None:
    app.command("run", rich_help_panel="Pipeline")(run_cmd)
    app.command("publish", rich_help_panel="Pipeline")(publish_cmd)
