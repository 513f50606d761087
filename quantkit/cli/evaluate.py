"""``quantkit eval``: perplexity, KL divergence and top-1 agreement of artifacts against their baseline; with
``--tasks``, lm-eval task accuracy instead (:mod:`quantkit.tasks`).

Flags override the ``evaluation:`` block of ``--recipe``, which overrides the defaults of the recipe schema. Nothing
heavy is imported until the command runs, so ``quantkit --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from quantkit import api
from quantkit.cli.common import JSON_OPT, RECIPE_OPT, command, emit_json, reporter
from quantkit.errors import UsageError
from quantkit.formats.names import EVALUATING, FIELD_FILES_SHOWN, TEXT_FILES_SHOWN

PANEL_PROTOCOL = "Protocol"
PANEL_GATES = "Gates"
PANEL_ENGINE = "Engine"
PANEL_TASKS = "Task accuracy"


def _summary(console: Any, report: Any) -> None:
    header, rows = report.table()
    t = Table(title=f"quantkit eval: {report.protocol.source}, ctx {report.protocol.ctx}, "
                    f"{report.protocol.tokens_scored:,} tokens", title_justify="left")
    for col in header:
        t.add_column(col, justify="right" if col in ("size", "bits/weight", "ppl", "ratio", "KLD", "top-1") else "left")
    for cells, passed in rows:
        if passed is None:
            t.add_row(*cells, style="dim")
        else:
            t.add_row(*cells[:-1], f"[green]{cells[-1]}[/]" if passed else f"[bold red]{cells[-1]}[/]")
    console.print(t)
    if report.report_path:
        console.print(f"report: {report.report_path}" + (f"  plot: {report.plot_path}" if report.plot_path else ""))


def _tasks_summary(console: Any, report: Any) -> None:
    header, rows = report.table()
    t = Table(title=f"quantkit eval --tasks: {len(report.artifacts)} artifact(s), "
                    f"{', '.join(x.name for x in report.tasks)}", title_justify="left")
    for col in header:
        t.add_column(col, justify="right" if col in ("baseline", "artifact", "recovery", "n", "shots") else "left")
    for cells, passed in rows:
        gate = cells[-1] if passed is None else f"[green]{cells[-1]}[/]" if passed else f"[bold red]{cells[-1]}[/]"
        t.add_row(*cells[:-1], gate)
    console.print(t)
    for engine, b in report.baselines.items():
        if b.scores.cached:
            console.print(f"baseline in {engine}: reused from the cache")
    if report.report_path:
        console.print(f"report: {report.report_path}")


@command
def eval_cmd(
    artifacts: list[Path] = typer.Argument(..., help="Artifact folders, .gguf files, checkpoints, or a release folder "
                                                     "of artifacts. A folder of several .gguf files gives one result "
                                                     "per file.", show_default=False),
    baseline: Optional[str] = typer.Option(None, "--baseline", "-b", help="The model the artifacts are compared "
                                           "with (folder or hub id) \\[default: the source recorded in their "
                                           "quantkit.json]."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Evaluation text: heldout, prose, code, mixed, a "
                                          f"{TEXT_FILES_SHOWN} file, a hub dataset (wikitext2, "
                                          "org/name\\[:config]\\[@split]), or auto = WikiText-2 test when the hub "
                                          "is reachable, else heldout \\[default: auto].",
                                          rich_help_panel=PANEL_PROTOCOL),
    field: Optional[str] = typer.Option(None, "--field", help="The field of each record holding the text, in a "
                                        f"{FIELD_FILES_SHOWN} file or an org/name hub dataset \\[default: text, "
                                        "else messages].", rich_help_panel=PANEL_PROTOCOL),
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Tokens per window, BOS included \\[default: 2048].",
                                      rich_help_panel=PANEL_PROTOCOL),
    stride: Optional[int] = typer.Option(None, "--stride", help="Slide windows by N tokens and score only the new "
                                         "ones (more context per token, more compute) \\[default: non-overlapping].",
                                         rich_help_panel=PANEL_PROTOCOL),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Score only the first N tokens of the text.",
                                             rich_help_panel=PANEL_PROTOCOL),
    engine: Optional[str] = typer.Option(None, "--engine", help="auto (llama.cpp for GGUF, vllm for ModelOpt "
                                         f"exports, else transformers), {', '.join(EVALUATING[:-1])} or "
                                         f"{EVALUATING[-1]}.",
                                         rich_help_panel=PANEL_ENGINE),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu, cuda or cuda:N \\[default: auto].",
                                         rich_help_panel=PANEL_ENGINE),
    python: Optional[str] = typer.Option(None, "--python", help="vLLM's or SGLang's own Python interpreter "
                                         "\\[default: $QUANTKIT_VLLM_PYTHON / $QUANTKIT_SGLANG_PYTHON, else this "
                                         "one].", rich_help_panel=PANEL_ENGINE),
    stall_timeout: Optional[float] = typer.Option(None, "--stall-timeout", min=0, help="Stop an engine whose load "
                                                  f"makes no progress ({api.NO_PROGRESS}) for S seconds, naming "
                                                  "it with its log's tail; 0: never \\[default: the recipe's "
                                                  "evaluation.stall_timeout, else 180].",
                                                  rich_help_panel=PANEL_ENGINE),
    numerics: Optional[str] = typer.Option(None, "--numerics", help="An FP4 W4A4 artifact's activations: auto "
                                           "(what the engine does: transformers emulates FP4 activations, vLLM on a "
                                           "GPU without FP4 arithmetic runs weight-only), emulated (FP4 activations "
                                           "quantized and dequantized: the numerics of a Blackwell GPU; vLLM: NVFP4 "
                                           "only) or weight-only (activations in 16 bits, as Hopper serves it). The "
                                           "result records which \\[default: auto].", rich_help_panel=PANEL_ENGINE),
    max_ppl_ratio: Optional[float] = typer.Option(None, "--max-ppl-ratio", help="Fail when artifact ppl / baseline "
                                                  "ppl exceeds X \\[default: recipe's, else 1.5].",
                                                  rich_help_panel=PANEL_GATES),
    max_kld: Optional[float] = typer.Option(None, "--max-kld", help="Fail when mean KL(baseline || artifact) "
                                            "exceeds X nats per token \\[default: recipe's, else 0.5].",
                                            rich_help_panel=PANEL_GATES),
    min_top1: Optional[float] = typer.Option(None, "--min-top1", help="Fail when top-1 agreement is below X "
                                             "\\[default: recipe's, else 0.6].", rich_help_panel=PANEL_GATES),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Score lm-eval tasks instead of perplexity: comma-"
                                        "separated shipped tasks (quantkit_lastword, quantkit_nextsentence, "
                                        "quantkit_lastword_gen), lm-eval task names, or task YAML paths. GGUF files "
                                        "take generation tasks only (llama-server refuses echo).",
                                        rich_help_panel=PANEL_TASKS),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Score only the first N items of each task.",
                                        rich_help_panel=PANEL_TASKS),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", min=0, help="Few-shot examples per prompt "
                                              "\\[default: each task's own].", rich_help_panel=PANEL_TASKS),
    min_recovery: Optional[float] = typer.Option(None, "--min-recovery", help="Fail when artifact / baseline is "
                                                 "below R on any task and metric \\[default: the recipe's "
                                                 "min_recovery per task, else no gate].", rich_help_panel=PANEL_TASKS),
    recipe: Optional[str] = RECIPE_OPT,
    report_dir: Optional[Path] = typer.Option(None, "--report-dir", help="Where report.md and the plot go "
                                              "\\[default: the artifact folder, or the common parent of several; "
                                              "./quantkit-eval for foreign checkpoints]; never into another "
                                              "artifact or release, whose seal they would break."),
    json: bool = JSON_OPT,
) -> None:
    """Perplexity, KL divergence and top-1 agreement of each artifact against its baseline, on the same tokens
    in every engine. Writes report.md, a size-vs-perplexity plot and each artifact's quantkit.json evaluation
    section. With --tasks: lm-eval task accuracy of the baseline and each artifact in the engine that serves it,
    and recovery (artifact / baseline) per task and metric, in tasks.md and the manifest. Exits 3 when a gate fails
    (after writing the report).

    [bold]Examples[/]

      [bold]$[/] quantkit eval out/awq out/gguf --dataset heldout --max-tokens 4096 --max-kld 0.1

      [bold]$[/] quantkit eval out/awq --baseline models/quantkit-tiny --dataset prose --ctx 1024 --max-tokens 4096

      [bold]$[/] quantkit eval out/gguf --tasks quantkit_lastword_gen --limit 20"""
    if tasks is not None:
        _refuse_unused({"--dataset": dataset, "--field": field, "--ctx": ctx, "--stride": stride,
                        "--max-tokens": max_tokens,
                        "--numerics": numerics, "--max-ppl-ratio": max_ppl_ratio, "--max-kld": max_kld,
                        "--min-top1": min_top1},
                       "--tasks (flags of the perplexity evaluation, which --tasks replaces)",
                       "run a second quantkit eval without --tasks for perplexity, KLD and top-1 and their gates")
        _eval_tasks(artifacts, baseline, tasks, limit, num_fewshot, min_recovery, engine, device, python, recipe,
                    report_dir, json, stall_timeout)
        return
    _refuse_unused({"--limit": limit, "--num-fewshot": num_fewshot, "--min-recovery": min_recovery},
                   "an eval without --tasks (flags of task scoring)", "add --tasks T1,T2")
    options, recipe_model = api.eval_options(
        recipe, flags={"dataset": dataset, "field": field, "ctx": ctx, "stride": stride, "max_tokens": max_tokens,
                       "engine": engine, "stall_timeout": stall_timeout},
        gate_flags={"max_ppl_ratio": max_ppl_ratio, "max_kld": max_kld, "min_top1": min_top1},
        device=device, python=python, report_dir=report_dir, numerics=numerics)
    rep = reporter(json)
    report = api.evaluate(artifacts, baseline or _manifest_or(recipe_model, artifacts), options, rep)
    if json:
        emit_json(report.to_json())
    else:
        _summary(rep.console, report)
    report.raise_for_gates()


def _refuse_unused(flags: dict[str, Any], mode: str, hint: str) -> None:
    """Refuse the flags given that the chosen evaluation does not read. ``--tasks`` and the perplexity protocol are
    two evaluations; a flag of the other one, silently dropped, read in CI as a gate that was checked
    (``--tasks T --max-kld 0.05`` exited 0 with no KLD computed)."""
    given = [name for name, value in flags.items() if value is not None]
    if given:
        raise UsageError(f"{_join(given)} {'does' if len(given) == 1 else 'do'} not apply to {mode}", hint=hint)


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _eval_tasks(artifacts: list[Path], baseline: Optional[str], tasks: str, limit: Optional[int],
                num_fewshot: Optional[int], min_recovery: Optional[float], engine: Optional[str],
                device: Optional[str], python: Optional[str], recipe: Optional[str], report_dir: Optional[Path],
                json: bool, stall_timeout: Optional[float]) -> None:
    options = api.task_options(tasks, recipe_path=recipe, num_fewshot=num_fewshot, limit=limit,
                               min_recovery=min_recovery, engine=engine, device=device or "auto", python=python,
                               report_dir=report_dir, stall_timeout=stall_timeout)
    rep = reporter(json)
    report = api.evaluate_tasks(artifacts, baseline, options, rep)
    if json:
        emit_json(report.to_json())
    else:
        _tasks_summary(rep.console, report)
    report.raise_for_gates()


def _manifest_or(recipe_model: str | None, artifacts: list[Path]) -> str | None:
    """The recipe's model is the baseline only when the artifacts do not record their own source."""
    if recipe_model is None or any((p if p.is_dir() else p.parent).joinpath(api.MANIFEST).exists() for p in artifacts):
        return None
    return recipe_model


def register(app: typer.Typer) -> None:
    app.command("eval", rich_help_panel="Verify")(eval_cmd)
