"""The quantization verbs: ``awq``, ``gptq``, ``fp8``, ``int8``, ``rtn`` and ``gguf``.

Each verb is ``quantkit METHOD MODEL OUTPUT [flags]`` or ``quantkit METHOD --recipe FILE [flags]``. The verbs
share their common flags (calibration, ignore list, device, trust) and differ only in their method flags, so
they are generated from one table: a flag is a recipe field, and the recipe schema validates it.
"""

from __future__ import annotations

import inspect as _inspect
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from quantkit.cli.common import FORCE_OPT, JSON_OPT, RECIPE_OPT, emit_json, handle_errors, reporter
from quantkit.errors import RecipeError


def _opt(default: Any, *names: str, help: str, **kw: Any) -> Any:
    return typer.Option(default, *names, help=help, **kw)


# (parameter name, annotation, typer option, recipe field)
COMMON: list[tuple[str, Any, Any, str]] = [
    ("calib", Optional[str], _opt(None, "--calib", help="Calibration data: prose, code, mixed, a .txt/.jsonl(.gz)/.parquet file, or a hub dataset (wikitext2, pile-val, c4, ultrachat, org/name[:config][@split]).", rich_help_panel="Calibration"), "calibration.dataset"),
    ("samples", Optional[int], _opt(None, "--samples", help="Number of calibration samples \\[default: 128].", rich_help_panel="Calibration"), "calibration.samples"),
    ("seq_len", Optional[int], _opt(None, "--seq-len", help="Tokens per calibration sample \\[default: 512].", rich_help_panel="Calibration"), "calibration.seq_len"),
    ("calib_field", Optional[str], _opt(None, "--calib-field", help="JSON/parquet field holding the text \\[default: text].", rich_help_panel="Calibration"), "calibration.field"),
    ("chat_template", Optional[bool], _opt(None, "--chat-template/--no-chat-template", help="Wrap calibration samples in the model's chat template.", rich_help_panel="Calibration"), "calibration.chat_template"),
    ("ignore", Optional[list[str]], _opt(None, "--ignore", help="Module name or re: pattern kept in full precision (repeatable) \\[default: lm_head].", rich_help_panel="Model"), "quantize.ignore"),
    ("revision", Optional[str], _opt(None, "--revision", help="Hub branch, tag or commit of the source model.", rich_help_panel="Model"), "model.revision"),
    ("dtype", Optional[str], _opt(None, "--dtype", help="Load dtype: auto, bfloat16, float16, float32.", rich_help_panel="Model"), "model.dtype"),
    ("trust_remote_code", Optional[bool], _opt(None, "--trust-remote-code", help="Allow the checkpoint's own Python code to run (off by default).", rich_help_panel="Model"), "model.trust_remote_code"),
    ("allow_pickle", Optional[bool], _opt(None, "--allow-pickle", help="Accept pickle (.bin/.pt) weights (unsafe; off by default).", rich_help_panel="Model"), "model.allow_pickle"),
    ("device", Optional[str], _opt(None, "--device", help="auto, cpu, cuda or cuda:N \\[default: auto].", rich_help_panel="Runtime"), "runtime.device"),
    ("num_gpus", Optional[int], _opt(None, "--num-gpus", help="GPUs for distributed calibration (launched through torchrun).", rich_help_panel="Runtime"), "runtime.num_gpus"),
    ("seed", Optional[int], _opt(None, "--seed", help="Seed for sampling calibration data and any randomness \\[default: 0].", rich_help_panel="Runtime"), "runtime.seed"),
]

BITS = ("bits", Optional[int], _opt(None, "--bits", help="Weight bits: 4 or 8 \\[default: 4]."), "quantize.bits")
GROUP = ("group_size", Optional[int], _opt(None, "--group-size", help="Weights per quantization group: 32, 64, 128, 256 or -1 for per-channel \\[default: 128]."), "quantize.group_size")

METHOD_FLAGS: dict[str, list[tuple[str, Any, Any, str]]] = {
    "awq": [BITS, GROUP,
            ("symmetric", Optional[bool], _opt(None, "--symmetric/--asymmetric", help="Symmetric quantization \\[default: asymmetric]."), "quantize.symmetric"),
            ("format", Optional[str], _opt(None, "--format", help="compressed-tensors, or autoawq to also write the legacy AutoAWQ GEMM layout."), "quantize.format")],
    "gptq": [BITS, GROUP,
             ("symmetric", Optional[bool], _opt(None, "--symmetric/--asymmetric", help="Symmetric quantization \\[default: symmetric, as vLLM's Marlin kernels need]."), "quantize.symmetric"),
             ("act_order", Optional[bool], _opt(None, "--act-order/--no-act-order", help="GPTQ activation ordering: quantize columns in order of decreasing activation magnitude (llm-compressor's static ordering: no g_idx, no runtime cost) \\[default: on]."), "quantize.act_order"),
             ("damp", Optional[float], _opt(None, "--damp", help="Hessian dampening fraction \\[default: 0.01]."), "quantize.damp"),
             ("format", Optional[str], _opt(None, "--format", help="compressed-tensors, or gptq to also write the legacy GPTQ layout."), "quantize.format")],
    "fp8": [("scheme", Optional[str], _opt(None, "--scheme", help="static (per-tensor weight + calibrated input scales), dynamic (per-channel weights, per-token activations at run time, no calibration), block (128x128 weight blocks) \\[default: static]."), "quantize.scheme"),
            ("kv_cache_fp8", Optional[bool], _opt(None, "--kv-cache-fp8", help="Also calibrate FP8 KV-cache scales."), "quantize.kv_cache_fp8")],
    "int8": [("smoothing_strength", Optional[float], _opt(None, "--smoothing-strength", help="SmoothQuant migration strength alpha in (0, 1) \\[default: 0.8]."), "quantize.smoothing_strength"),
             ("weights", Optional[str], _opt(None, "--weights", help="gptq or rtn for the INT8 weights \\[default: gptq]."), "quantize.weights")],
    "rtn": [BITS, GROUP,
            ("symmetric", Optional[bool], _opt(None, "--symmetric/--asymmetric", help="Symmetric quantization \\[default: symmetric]."), "quantize.symmetric")],
    "gguf": [("types", Optional[list[str]], _opt(None, "--type", "-t", help="GGUF type, repeatable: F32, F16, BF16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0, Q3_K_M, Q2_K, IQ4_XS ... \\[default: Q4_K_M]."), "quantize.types"),
             ("imatrix", Optional[bool], _opt(None, "--imatrix-calib/--no-imatrix-calib", help="Compute llama.cpp's importance matrix from the calibration set for the low-bit types."), "quantize.imatrix")],
}

HELP = {
    "awq": "AWQ int4 (W4A16, group 128, asymmetric) through llm-compressor: activation-aware scales, then group quantization. Writes a compressed-tensors checkpoint vLLM and transformers load.",
    "gptq": "GPTQ int4/int8 (W4A16/W8A16, group 128, symmetric) through llm-compressor: second-order error compensation. Writes a compressed-tensors checkpoint.",
    "fp8": "FP8 E4M3 weights with their scale tensors (static, dynamic or 128x128 block scales), optionally FP8 KV cache. Writes a compressed-tensors checkpoint.",
    "int8": "SmoothQuant, then W8A8 INT8 (per-channel weights, dynamic per-token activations) with GPTQ or round-to-nearest weights.",
    "rtn": "Round-to-nearest W4A16/W8A16 with no calibration: the instant option, and the baseline AWQ and GPTQ must beat.",
    "gguf": "GGUF files for llama.cpp: convert once (F32/F16/BF16/Q8_0 written directly), then each --type through llama.cpp's own quantizer.",
}


def _quantize(method: str, values: dict[str, Any]) -> None:
    from quantkit import api, recipe as recipe_mod

    flags = {name: (field, opt) for name, _, opt, field in COMMON + METHOD_FLAGS[method]}
    overrides: dict[str, Any] = {}
    for name, (field, opt) in flags.items():
        value = values.get(name)
        if value is not None and value != []:
            flag = opt.param_decls[0].split("/")[0] if opt.param_decls else f"--{name}"
            overrides[f"{field}|{flag}"] = value
    model, output, recipe_path = values["model"], values["output"], values["recipe"]
    if model is not None:
        overrides["model.source|MODEL"] = model
    if output is not None:
        overrides["output|OUTPUT"] = output
    base: dict[str, Any] = {"quantize": {"method": method}}
    path = recipe_mod.find(recipe_path) if recipe_path else None
    if path is None and (model is None or output is None):
        raise RecipeError(f"give MODEL and OUTPUT, or --recipe FILE (see `quantkit {method} --help`)")
    r = recipe_mod.load(path, overrides, base=base)
    if r.quantize is None or r.quantize.method != method:
        got = r.quantize.method if r.quantize else "a multi-output"
        raise RecipeError(f"{path} is {got} recipe, not {method}",
                          hint=f"use `quantkit {got if r.quantize else 'run'} --recipe {path}`")
    rep = reporter(values["json"])
    results = api.quantize(r, force=values["force"], reporter=rep)
    if values["json"]:
        emit_json([x.to_json() for x in results])
        return
    _summary(rep.console, results)


def _summary(console: Any, results: list[Any]) -> None:
    from quantkit.artifact import fmt_bytes

    t = Table(title="quantkit", title_justify="left")
    for col in ("artifact", "format", "quantization", "size", "vs source", "calibration", "time"):
        t.add_column(col)
    for r in results:
        m = r.manifest
        size = sum(f["size"] for f in m["files"].values())
        src = (m.get("source") or {}).get("size_bytes") or 0
        calib = m.get("calibration")
        q = m.get("quantization") or {}
        t.add_row(str(r.path), m["format"], str(q.get("scheme", m["method"])), fmt_bytes(size),
                  f"{src / size:.2f}x smaller" if src and size else "-",
                  f"{calib['samples']}x{calib['seq_len']} {calib['dataset']}" if calib else "none",
                  f"{m['timings'].get('total', 0):.1f}s")
    console.print(t)


def _make_verb(method: str):  # noqa: ANN202 - builds a Typer command
    params = [
        _inspect.Parameter("model", _inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                           default=typer.Argument(None, help="Source checkpoint: a local folder or a hub id (org/name).", show_default=False)),
        _inspect.Parameter("output", _inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                           default=typer.Argument(None, help="Output folder (written atomically; refused if it exists, unless --force).", show_default=False)),
        _inspect.Parameter("recipe", _inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str], default=RECIPE_OPT),
    ]
    for name, ann, opt, _field in METHOD_FLAGS[method] + COMMON:
        params.append(_inspect.Parameter(name, _inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=opt))
    params += [
        _inspect.Parameter("force", _inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=FORCE_OPT),
        _inspect.Parameter("json", _inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=JSON_OPT),
    ]

    def verb(**values: Any) -> None:
        if values.get("output") is not None:
            values["output"] = str(values["output"])
        _quantize(method, values)

    verb.__signature__ = _inspect.Signature(params)  # type: ignore[attr-defined]
    verb.__name__ = method
    verb.__doc__ = HELP[method]
    return handle_errors(verb)


def register(app: typer.Typer, methods: tuple[str, ...] = ("awq", "gptq", "fp8", "int8", "rtn", "gguf")) -> None:
    for method in methods:
        app.command(method, help=HELP[method], rich_help_panel="Quantize")(_make_verb(method))
