"""``build-trt``: a recipe's TensorRT-LLM outputs: ModelOpt checkpoints, then the engine where TensorRT-LLM exists.

The quantization itself runs in the ModelOpt environment (see :mod:`quantkit.producers.trt.pyenv`); this module
only parses flags, calls :func:`quantkit.api.build_trt`, and renders the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from quantkit import api
from quantkit.cli.common import DRY_RUN_OPT, FORCE_OPT, JSON_OPT, command, emit_json, print_plan, reporter
from quantkit.errors import BackendError

HELP = ("TensorRT-LLM through NVIDIA ModelOpt: calibrate and quantize (fp8, int8_sq, int4_awq, w4a8_awq, nvfp4, "
        "w4a16_nvfp4, or none: 16-bit weights, with the recipe's kv_cache quantized if it sets one), write the "
        "unified Hugging Face checkpoint (hf/: vLLM, SGLang, TensorRT-LLM's LLM API) and the TensorRT-LLM checkpoint "
        "(trtllm-ckpt/: one rank{N}.safetensors per tp x pp rank), then compile and try an engine (engine/) where "
        "TensorRT-LLM <= 1.2 is installed. ModelOpt runs in its own Python environment (--python)."
        "\n\n[bold]Examples[/]"
        "\n\n  [bold]$[/] quantkit build-trt trt-fp8 --checkpoint-only"
        "\n\n  [bold]$[/] quantkit build-trt recipes/trt-int4-awq.yaml -o out/trt-awq --dry-run")


@command
def build_trt_cmd(
    recipe: str = typer.Argument(..., help="Recipe YAML (or a shipped recipe's name, e.g. trt-fp8) with a "
                                 "'quantize: {method: trt, ...}' section or trt outputs.", show_default=False),
    checkpoint_only: bool = typer.Option(False, "--checkpoint-only", help="Stop after the checkpoints (step 1); "
                                         "do not build an engine."),
    python: Optional[str] = typer.Option(None, "--python", help="The ModelOpt environment's Python \\[default: "
                                         "runtime.python, QUANTKIT_TRT_PYTHON, .venv-trt/bin/python, this Python]."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact folder (one output) or release "
                                          "folder (several) \\[default: the recipe's output]."),
    force: bool = FORCE_OPT,
    dry_run: bool = DRY_RUN_OPT,
    json: bool = JSON_OPT,
) -> None:
    """Build a recipe's TensorRT-LLM artifact(s): ModelOpt checkpoints, and the engine where it can be built."""
    r = api.trt_recipe(recipe, checkpoint_only=checkpoint_only, python=python, output=str(output) if output else None)
    if dry_run:
        planned = api.plan(r, force=force, method="trt")
        print_plan(planned, json)
        planned.check()  # exit 2 where the build would refuse, once the plan is shown
        return
    rep = reporter(json)
    results = api.build_trt(r, force=force, reporter=rep)
    failed = [res for res in results if (res.manifest.quantization.get("engine") or {}).get("status") == "failed"]
    if json:
        emit_json([res.to_json() for res in results])
    else:
        _summary(rep.console, results)
    if failed:
        raise BackendError(f"the engine step failed for {', '.join(str(x.path) for x in failed)} (the checkpoints "
                           "were written)", hint="see the note above; rerun with --checkpoint-only to skip step 2")


def _dir_bytes(files: dict[str, Any], prefix: str) -> int:
    return sum(f.size for name, f in files.items() if name.startswith(prefix + "/"))


def _summary(console: Any, results: list[Any]) -> None:
    t = Table(title="quantkit build-trt", title_justify="left")
    for col in ("artifact", "quantization", "kv cache", "tp x pp", "hf/", "trtllm-ckpt/", "engine", "calibration",
                "time"):
        t.add_column(col, overflow="fold")
    for res in results:
        m = res.manifest
        q = m.quantization
        calib = m.calibration
        eng = q.get("engine") or {}
        engine_cell = eng.get("status", "-")
        if eng.get("status") in ("ran", "built"):
            engine_cell += f" ({api.fmt_bytes(_dir_bytes(m.files, q['layout']['engine']))})"
        t.add_row(str(res.path), f"{q['scheme']} ({q.get('quant_algo')})", str(q.get("kv_cache_quant_algo") or "-"),
                  f"{q['tp']} x {q['pp']}", api.fmt_bytes(_dir_bytes(m.files, q["layout"]["hf"])),
                  api.fmt_bytes(_dir_bytes(m.files, q["layout"]["trtllm_checkpoint"])), engine_cell,
                  f"{calib.samples}x{calib.seq_len} {calib.dataset}" if calib else "none",
                  f"{m.timings.get('total', 0):.1f}s")
    console.print(t)
    for res in results:
        for note in res.manifest.notes:
            console.print(f"[dim]{escape(str(Path(res.path)))}:[/] {escape(note)}", soft_wrap=True)
        for g in (res.manifest.quantization.get("engine") or {}).get("generated") or []:
            console.print(f"  {escape(g['prompt'])!s} -> {escape(g['text'])!s}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("build-trt", help=HELP, rich_help_panel="Quantize")(build_trt_cmd)
