"""``quantkit eval``: score artifacts against their baseline on one protocol, check gates, write the report.

    from quantkit.evaluation.evaluate import EvalOptions, evaluate
    report = evaluate([Path("out/rtn-w4g128")], None, EvalOptions(dataset="heldout", max_tokens=8192))
    report.raise_for_gates()

Tested with the engines' versions named in :mod:`quantkit.engines.registry` (transformers 5.17.0, llama-cpp-python
0.3.36).

Order of work: every cheap check first (artifact paths, manifests and their sha256, the baseline, gate limits),
then the protocol (tokenize once), then the baseline through its engine once, its distributions stored (on its
device when they fit, else on disk: :class:`~quantkit.evaluation.metrics.BaselineStore`), then each artifact
through its engine, compared batch by batch against the stored baseline on the device where the artifact's
log-probabilities are, only per-token figures moved to the host. Each engine is
closed before the next loads, so one GPU holds one model at a time. Results go into a report (markdown + plot)
and into each artifact's ``quantkit.json`` (``evaluation`` section) before any gate is enforced, so a failed
gate still leaves its evidence behind.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.markup import escape

from quantkit import integrity, outputs, source as source_mod
from quantkit.checkpoint import gguf_files
from quantkit.engines import logits as engines, numerics as numerics_mod, registry
from quantkit.engines.logits import EngineOptions
from quantkit.errors import IntegrityError, UsageError
from quantkit.formats import kinds
from quantkit.formats.names import LLAMACPP, SGLANG, TRANSFORMERS, VLLM, Method
from quantkit.manifest import MANIFEST, Manifest, read_manifest, size_bytes
from quantkit.progress import Reporter
from quantkit.recipe import DEFAULT_STALL_TIMEOUT, EvaluationSpec, GateSpec, ModelSpec
from quantkit.evaluation import gates as gates_mod, images as images_mod, protocol as protocol_mod, report as report_mod
from quantkit.evaluation import vocabulary
from quantkit.evaluation.metrics import BaselineStore, Metrics, score_windows
from quantkit.evaluation.results import EvalReport, Result, Target


@dataclass
class EvalOptions:
    """How to evaluate: the protocol, the engine, the gates and where the report goes."""

    dataset: str = "auto"
    text_field: str = "text"
    ctx: int = 2048
    stride: int | None = None
    max_tokens: int | None = None
    engine: str = "auto"
    device: str = "auto"
    gate_flags: dict[str, float | None] = field(default_factory=dict)
    recipe_gates: GateSpec | None = None
    report_dir: Path | None = None
    python: str | None = None
    vllm_topk: int = 20
    kld_topk: int | None = None
    write: bool = True
    image_prompts: int = images_mod.DEFAULT_PROMPTS  # a vision-language model's image prompts scored (0: none)
    numerics: str = numerics_mod.AUTO  # an FP4 W4A4 artifact's activations: auto, emulated, weight-only
    batch: int | None = None  # transformers: windows per forward pass (None: chosen from free memory)
    stall_timeout: float = DEFAULT_STALL_TIMEOUT  # vLLM, SGLang: a load without progress this long is stopped

    @classmethod
    def from_spec(cls, spec: EvaluationSpec, **overrides: Any) -> "EvalOptions":
        """Options from a recipe's ``evaluation`` block, with explicit (non-None) overrides on top."""
        base = {"dataset": spec.dataset, "text_field": spec.field, "ctx": spec.ctx, "stride": spec.stride,
                "max_tokens": spec.max_tokens, "engine": spec.engine, "recipe_gates": spec.gates,
                "stall_timeout": spec.stall_timeout}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


def options_from(recipe_path: str | None, flags: dict[str, Any], gate_flags: dict[str, float | None],
                 **engine: Any) -> tuple[EvalOptions, str | None]:
    """``quantkit eval``'s options: the ``evaluation`` block of a recipe (if given), its fields overridden by flags
    (``flags``: dataset, field, ctx, stride, max_tokens, engine), the gate flags, and engine settings (device, python,
    report_dir). Returns them with the recipe's source model, which is the baseline only for artifacts that do
    not record their own. Without a recipe the artifacts' own recipes (then the schema defaults) decide gates."""
    from quantkit import recipe as recipe_mod

    data: dict[str, Any] = {}
    model = None
    if recipe_path:
        r = recipe_mod.load(recipe_mod.find(recipe_path), check_output_escape=False)  # eval writes no output
        data = r.evaluation.model_dump()
        model = r.model.source
    data.update({k: v for k, v in flags.items() if v is not None})
    try:
        spec = EvaluationSpec.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg'].removeprefix('Value error, ')}"
                             f" (got {err.get('input')!r})" for err in e.errors())
        raise UsageError(f"invalid evaluation option: {problems}") from None
    options = EvalOptions.from_spec(spec, gate_flags=gate_flags, **engine)
    if not recipe_path:
        options.recipe_gates = None
    return options, model


# ---------------------------------------------------------------------------------------------------------------
# Targets and baseline


def _describe_format(path: Path, manifest: Manifest | None) -> str:
    from quantkit.inspection import checkpoint_quantization, describe_gguf_files

    method = manifest.method if manifest else None
    if engines.is_gguf(path):
        info = describe_gguf_files(path)[0]
        text = f"gguf {str(info.get('type', '?')).removeprefix('ALL_')}"
    else:
        q = checkpoint_quantization(path)  # every config group of a mix, not the first alone
        named = manifest.quantization.get("scheme") if manifest else None
        if isinstance(named, str):
            q["scheme"] = named
        fmt = q.get("format", "?")
        if fmt == "compressed-tensors":
            gs = q.get("group_size")  # one size for every group ("16+none" for a mix with per-channel layers)
            text = f"compressed-tensors {q.get('scheme')}" + (f" g{gs}" if isinstance(gs, int) else "")
        elif fmt == "hf":
            text = f"hf {q.get('dtype') or '?'}"
        else:
            text = f"{fmt} {q.get('scheme') or ''}".strip()
    return f"{method}: {text}" if method and method != Method.GGUF else text


def _manifest_of(folder: Path) -> Manifest | None:
    """The folder's manifest after checking its seal: evaluating a tampered artifact would re-seal it."""
    if not (folder / MANIFEST).exists():
        return None
    check = integrity.verify(folder)
    if not check.ok:
        raise IntegrityError(f"{folder}: files differ from its manifest (changed: {check.changed}, missing: "
                             f"{check.missing}, not in manifest: {check.extra})",
                             hint=f"run `quantkit verify {folder}`; re-create the artifact if it was damaged")
    return read_manifest(folder)


def expand_targets(paths: list[Path], engine: str, numerics: str = numerics_mod.AUTO) -> list[Target]:
    """The models a list of paths stands for: a checkpoint folder, each GGUF file of a folder, or each artifact
    folder of a release folder. Checks engines, ``--numerics`` and manifests before anything loads."""
    out: list[Target] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise UsageError(f"artifact {path} does not exist")
        if path.is_dir() and not (path / "config.json").exists() and not gguf_files(path):
            subs = sorted(p.parent for p in path.glob(f"*/{MANIFEST}"))
            if not subs:
                if kinds.find(path) is not None:  # a build-trt artifact: refused naming the folder to evaluate
                    registry.evaluating_engine(path)
                raise UsageError(f"{path} is not a checkpoint, a GGUF artifact or a release folder of artifacts",
                                 hint="give an artifact folder, a Hugging Face checkpoint or a .gguf file")
            out += expand_targets(subs, engine, numerics)
            continue
        home = integrity.artifact_of(path) or (path.parent if path.is_file() else path)  # hf/ of a build-trt one
        manifest = _manifest_of(home)
        kind = registry.evaluating_engine(path) if engine == "auto" else engine
        engines.check_compatible(kind, path)
        numerics_mod.check(path, numerics, kind)
        files = gguf_files(path) if kind == LLAMACPP else [path]
        for f in files:
            label = f"{home.name}/{f.name}" if f != home else home.name
            out.append(Target(label=label, path=f, engine=kind, manifest_dir=home if manifest else None,
                              manifest=manifest, format=_describe_format(f, manifest),
                              size_bytes=size_bytes(f)))
    labels = [t.label for t in out]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise UsageError(f"{dup[0]} is given twice")
    return out


def resolve_baseline(given: str | None, targets: list[Target]) -> source_mod.SourceModel:
    """The baseline: ``--baseline``, else the source recorded in the artifacts' manifests (one for all)."""
    if given is None:
        found = {_recorded_source(t) for t in targets}
        found.discard(None)
        if not found:
            raise UsageError("no baseline: the artifacts have no quantkit.json recording their source model",
                             hint="pass --baseline MODEL (the checkpoint they were made from)")
        if len(found) > 1:
            raise UsageError(f"the artifacts come from different source models ({', '.join(sorted(found))}); "
                             "evaluating them together needs one baseline", hint="pass --baseline MODEL")
        given = found.pop()
    if gguf_files(Path(given)):
        raise UsageError(f"the baseline {given} is GGUF; the baseline must be a Hugging Face checkpoint (its "
                         "tokenizer defines the protocol's tokens)")
    src = source_mod.resolve(ModelSpec(source=given))
    for t in targets:
        recorded = t.manifest.source if t.manifest else None
        if recorded and recorded.config_sha256 != src.config_sha256:
            raise UsageError(f"{t.label} was made from a model whose config.json differs from the baseline {given}'s",
                             hint="evaluate it against the model it was made from (--baseline)")
        if recorded and recorded.weights_sha256 and recorded.weights_sha256 != src.weights_sha256():
            raise UsageError(f"{t.label} was made from other weights than the baseline {given}'s (the same config.json, "
                             "weight files with other bytes)",
                             hint="evaluate it against the model it was made from (--baseline), or make it again")
    return src


def _recorded_source(t: Target) -> str | None:
    """The source model an artifact's manifest records, found on this machine (or a hub id to download)."""
    if t.manifest is None:
        return None
    src = t.manifest.source
    local = src.local_path()
    if local is not None:
        return str(local)
    if src.hub:
        return src.id
    raise UsageError(f"{t.label} was made from the local model {src.id!r} ({src.path}), which is not found from "
                     "here", hint="pass --baseline with that model's folder")


# ---------------------------------------------------------------------------------------------------------------
# Running engines


def _preflight(kinds: set[str], options: EvalOptions) -> None:
    """Fail on a missing engine now, not after the baseline has run for an hour."""
    import importlib.util

    from quantkit.errors import MissingBackendError

    if LLAMACPP in kinds and importlib.util.find_spec("llama_cpp") is None:
        raise MissingBackendError("llama_cpp", "gguf", "evaluating GGUF files")
    if VLLM in kinds:
        from quantkit.engines.vllm.logits import find_python

        find_python(options.python)
    if SGLANG in kinds:
        from quantkit.engines.sglang.logits import find_python as find_sglang_python

        find_sglang_python(options.python)


def _engine_options(options: EvalOptions) -> EngineOptions:
    return EngineOptions(ctx=options.ctx, device=options.device, python=options.python, topk=options.vllm_topk,
                         numerics=options.numerics, batch=options.batch, stall_timeout=options.stall_timeout)


def _score(label: str, kind: str, path: Path, proto: protocol_mod.Protocol, options: EvalOptions,
           reporter: Reporter, store: BaselineStore, is_baseline: bool) -> tuple[Metrics, dict[str, Any], float]:
    """Run one model over every window; the baseline fills the store, the others are compared against it where
    their log-probabilities are (:func:`quantkit.evaluation.metrics.score_rows`)."""
    start = time.perf_counter()
    with reporter.step(f"load:{label}", f"loading {label} in {kind}"):
        engine = engines.open_engine(kind, path, _engine_options(options))
    try:
        info = engine.info()
        if line := info.pop("numerics_line", None):  # an FP4 W4A4 artifact: which arithmetic these scores are
            say = reporter.warn if info.get("numerics") in (None, numerics_mod.MARLIN_WEIGHT_ONLY) else reporter.log
            say(f"{label}: {line}")
        with reporter.bar(f"{label} ({kind})", total=proto.tokens_scored, unit="tok") as bar:
            t0, done = time.perf_counter(), 0

            def advance(n: int) -> None:
                nonlocal done
                done += n
                bar.advance(n)
                bar.update(rate=f"{done / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")

            metrics = score_windows(engine, proto.windows, store, baseline=is_baseline, progress=advance)
            info["scoring_s"] = round(time.perf_counter() - t0, 3)
            info["scored_tokens_per_s"] = round(done / max(time.perf_counter() - t0, 1e-9), 1)
            if facts := getattr(engine, "scoring_facts", None):  # vLLM: its own share of that time
                info.update(facts())
    finally:
        engine.close()
    return metrics, info, time.perf_counter() - start


def _score_images(source: Path, results: list[Result], options: EvalOptions, rep: Reporter) -> None:
    """A vision-language model's image prompts: the baseline answers once, each artifact scored in transformers
    (exact) or vLLM (a top-k lower bound) is compared over those answers; another engine's result says it was not
    scored there."""
    from quantkit.devices import resolve_device

    device = resolve_device(options.device)
    with rep.step("images:baseline", f"answering {options.image_prompts} image prompts with the baseline"):
        base = images_mod.baseline(source, device, options.image_prompts)
    if base.reason:
        rep.warn(f"image prompts not scored: {base.reason}")
    for r in results:
        if r.target.engine not in (TRANSFORMERS, VLLM):
            r.images = base.manifest_base() | {"scored": False, "reason": f"image prompts are scored in transformers "
                                                                          f"and vLLM; {r.target.engine} scored text only"}
            continue
        with rep.step(f"images:{r.target.label}", f"scoring {r.target.label} on the baseline's image answers"):
            r.images = images_mod.score(r.target.path, base, device) if r.target.engine == TRANSFORMERS else \
                images_mod.score_vllm(r.target.path, base, _engine_options(options))
        if r.images.get("scored"):
            rep.log(f"{r.target.label}: image prompts KLD {r.images['kld']:.4f}, top-1 {r.images['top1']:.3f} over "
                    f"{r.images['answer_tokens']} answer tokens of {r.images['prompts']} images")


def _bpw(size_bytes: int, params: int) -> float | None:
    return round(8 * size_bytes / params, 3) if params and size_bytes else None


def _report_dir(options: EvalOptions, targets: list[Target]) -> Path:
    """``--report-dir``; else the artifact folder (one artifact) or their common parent; else ./quantkit-eval."""
    if options.report_dir is not None:
        return Path(options.report_dir)
    if all(t.manifest_dir is not None for t in targets):
        homes = sorted({t.manifest_dir for t in targets if t.manifest_dir is not None})
        if len(homes) == 1:
            return homes[0]
        common = Path(os.path.commonpath([h.resolve() for h in homes]))
        if common != Path(common.anchor):
            return common
    return Path("quantkit-eval")


def evaluate(paths: list[Path], baseline: str | None, options: EvalOptions | None = None,
             reporter: Reporter | None = None) -> EvalReport:
    """Evaluate artifacts against one baseline (see the module docstring); gates are checked, not enforced."""
    options = options or EvalOptions()
    rep = reporter or Reporter(quiet=True)
    if not paths:
        raise UsageError("give at least one artifact to evaluate")
    if options.stride is not None and options.stride > options.ctx:
        raise UsageError(f"--stride {options.stride} is larger than --ctx {options.ctx}: tokens would be skipped",
                         hint="leave --stride out for non-overlapping windows")
    targets = expand_targets(paths, options.engine, options.numerics)
    _preflight({t.engine for t in targets}, options)
    src = resolve_baseline(baseline, targets)
    vocabulary.check(targets, src)  # every engine's artifact, before the baseline is scored
    if options.write:  # before any scoring: not into the baseline, over the user's files, nor another's seal
        text = Path(os.path.expanduser(options.dataset))
        folder, names = _report_dir(options, targets), (report_mod.REPORT, report_mod.PLOT)
        outputs.check_files(folder, names, src.path, [("evaluation file", text)] if text.exists() else [])
        outputs.check_outside_seals(folder, names, [t.manifest_dir or t.path for t in targets])
    for t in targets:
        t.gates = gates_mod.resolve(options.gate_flags, options.recipe_gates,
                                    t.manifest.recipe_gates if t.manifest else None)
    with rep.step("protocol", "tokenizing the evaluation text with the baseline's tokenizer"):
        proto = protocol_mod.build(src.path, dataset=options.dataset, field_name=options.text_field, ctx=options.ctx,
                                   stride=options.stride, max_tokens=options.max_tokens)
    windows = f"{len(proto.windows)} window{'s' * (len(proto.windows) != 1)}"
    rep.log(f"protocol: {escape(proto.source)} ({proto.kind}), {windows} of ctx {proto.ctx}"
            f"{f', stride {proto.stride}' if proto.stride else ''}, {proto.tokens_scored:,} tokens scored")
    for note in proto.notes:  # the report has them too; a console reader should not have to open it to learn them
        rep.log(f"[yellow]note:[/] {escape(note)}")
    with tempfile.TemporaryDirectory(prefix="quantkit-eval-") as tmp:
        store = BaselineStore(Path(tmp), proto.tokens_scored, options.kld_topk,
                              shared_gpu=any(t.engine in (VLLM, SGLANG) for t in targets))
        base_kind = TRANSFORMERS  # full distributions, and the tokenizer's own framework
        m, info, secs = _score("baseline", base_kind, src.path, proto, options, rep, store, is_baseline=True)
        base_target = Target(label=f"{src.path.name} (baseline)", path=src.path, engine=base_kind, manifest_dir=None,
                             manifest=None, format=_describe_format(src.path, None),
                             size_bytes=size_bytes(src.path))
        m.kld, m.kld_median, m.kld_p99, m.kld_max, m.top1 = 0.0, 0.0, 0.0, 0.0, 1.0
        base = Result(target=base_target, engine=info, metrics=m, ppl_ratio=1.0,
                      bits_per_weight=_bpw(base_target.size_bytes, src.num_parameters), seconds=secs)
        results = []
        for t in targets:
            m, info, secs = _score(t.label, t.engine, t.path, proto, options, rep, store, is_baseline=False)
            ratio = m.ppl / base.metrics.ppl if base.metrics.ppl else None
            r = Result(target=t, engine=info, metrics=m, ppl_ratio=ratio,
                       bits_per_weight=_bpw(t.size_bytes, src.num_parameters), seconds=secs,
                       numerics=info.get("numerics"))
            if t.engine in (VLLM, SGLANG):
                r.kld_method = (f"lower bound: {'vLLM' if t.engine == VLLM else 'SGLang'} returns the artifact's "
                                f"top-{options.vllm_topk} log-probabilities, used as bins plus one bin for the rest "
                                "of the vocabulary")
            r.gates = gates_mod.check(r.figures(), t.gates or GateSpec())
            results.append(r)
        kld_method = store.kld_method
    if options.image_prompts > 0 and images_mod.is_vision_language(src.path):
        _score_images(src.path, results, options, rep)
    report = EvalReport(protocol=proto, baseline=base, results=results, kld_method=kld_method)
    if options.write:
        report_mod.write(report, _report_dir(options, targets), rep)
        report_mod.update_manifests(report)
    return report
