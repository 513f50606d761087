"""llm-compressor: AWQ, GPTQ, AutoRound, FP8, INT8 SmoothQuant, round-to-nearest and FP4 (NVFP4, MXFP4) ->
compressed-tensors checkpoints.

Each recipe spec maps, through one declarative table (:mod:`quantkit.producers.modifiers`), to the llm-compressor
modifiers that make it; the model is loaded with transformers, calibrated with quantkit's own token samples (passed to
``oneshot`` as a ``datasets.Dataset`` of ``input_ids``, never re-tokenized by llm-compressor), and saved with
``save_compressed=True`` so vLLM and transformers load it (:mod:`quantkit.producers.oneshot`). quantkit adds the
flags, the calibration set and its hash, the progress and the manifest; every algorithm is llm-compressor's. This
module is the orchestration: the checks before anything loads, then load, (bits plan,) quantize, check, save.

* Widths: an unset group size is 128, or the largest group size vLLM's kernels take that divides every layer's input
  width (:mod:`quantkit.producers.groups`: 64 on SmolLM2's 576), said in one warning and recorded; for
  ``gptq --target-bits`` with no group size or symmetry given, 32 with zero points (said and recorded too); a given
  one that does not divide, and FP8 blocks or W4A8 groups of 128 where 128 does not divide, are refused before
  anything loads.
  FP4's groups are fixed by the format (16 NVFP4, 32 MXFP4): a layer whose input width they do not divide is kept
  unquantized, said in one warning and recorded (refused where nothing, or an MoE expert, would be left).
* Ignore lists: one that leaves nothing to quantize, keeps an MoE expert, or keeps only part of q/k/v or gate/up
  (layers vLLM fuses) is refused before anything loads (:func:`groups.check_ignore`).
* Memory: llm-compressor's sequential pipeline (inferred for AWQ, GPTQ, SmoothQuant and static FP8) keeps the
  model on the CPU and moves one decoder layer at a time to the GPU, so GPU memory is about one layer's weights
  plus the calibration activations; the CPU needs the whole model in its load dtype. RTN, FP8 dynamic and FP8
  block need no data and run layer by layer through the data-free pipeline.
* ``runtime.num_gpus > 1`` relaunches the same job under ``torchrun`` (:mod:`quantkit.producers.torchrun`).
* ``--format autoawq`` / ``--format gptq`` are their own registry rows, made by :mod:`quantkit.producers.legacy`
  on top of this producer's checkpoint.
* After quantizing, :mod:`quantkit.producers.coverage` checks that every module that should be quantized was (for
  an MoE, every expert projection of every layer) with finite, positive scales; otherwise the run fails (exit 1)
  and nothing is published.

Tested with llmcompressor 0.14.0.1, compressed-tensors 0.19.0, auto-round 0.15.1, transformers 5.17.0, torch 2.13.0
(CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from quantkit import ignore as ignore_mod
from quantkit.errors import SourceModelError, UsageError
from quantkit.formats.names import Method
from quantkit.architectures import text_config
from quantkit.producers import mixed, moe, oneshot, sensitivity, torchrun, vision
from quantkit.producers.base import ProduceContext, Produced
from quantkit.producers.groups import (Checked, check_ignore, check_tiles, group_choice, input_widths, narrow_layers,
                                      narrow_note)
from quantkit.producers.job import Job
from quantkit.producers.modifiers import autoround_batch, plan
from quantkit.recipe import CalibrationSpec
from quantkit.source import SourceModel, load_tokenizer


def _check_target_bits(spec: Any, source: SourceModel) -> None:
    """Refuse a bits target quantkit cannot plan here, before anything loads: on a mixture-of-experts model (vLLM's
    fused MoE layers take one scheme for all experts of a layer, and the expert weights are most of the model), or
    one outside what its two precisions mix to."""
    if moe.family(source.config):
        raise UsageError(f"--target-bits plans dense layers; {source.spec} is a mixture-of-experts model",
                         hint="drop --target-bits (and choose --bits 4 or 8), or use fp8 / int8")
    mixed.check_target(spec.target_bits, *mixed.precisions(spec), list(input_widths(source.config).values()))


def _bits_plan(model: Any, job: Job, device: str, rep: Any, source: SourceModel,
               tokens_sha256: str) -> tuple[list[mixed.Unit], dict[str, Any], str | None]:
    """Measure each layer group's low-precision sensitivity on the model as loaded (moved to the GPU for it, when
    there is one, and back), or read it from the cache (:mod:`quantkit.producers.sensitivity`), then choose which
    groups go to 8 bits; says the choice in one line. Returns the plan, the measurement's record and the note a
    cached measurement leaves in the manifest."""
    import torch

    spec = job.spec
    low, high = mixed.precisions(spec)
    found = mixed.units(model, job.ignore)
    where = "cuda" if device == "cuda" else "cpu"
    name = sensitivity.key(source, tokens_sha256, low, found, job.dtype, where)
    cached = sensitivity.read(name, found)
    if cached is not None:
        measured, record = cached
        note = (f"the {low.name} sensitivity of the {len(found)} layer groups was read from quantkit's cache "
                f"(sensitivity/{name[:16]}, measured in {record.get('seconds', '?')} s by an earlier run on the same "
                "source and calibration tokens)")
        rep.log(note)
        return _choose(measured, spec, low, high, rep), {**record, "cache": "read", "cache_key": name}, note
    if where == "cuda":
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        free, _ = torch.cuda.mem_get_info()
        if weights * 1.2 > free:  # the weights, the kept reference log-probabilities and one forward's activations
            raise UsageError(f"--target-bits measures each layer group with the whole model on one GPU, and its "
                             f"{weights / 2**30:.1f} GiB of weights do not fit in the {free / 2**30:.1f} GiB free",
                             hint="use a GPU with more memory, or drop --target-bits")
    with rep.timed("sensitivity"), rep.bar(f"Measuring the {low.name} KLD of {len(found)} layer groups on {where}",
                                           len(found)) as task:
        model.to(where)
        try:
            measured, record = mixed.measure(model, found, job.samples or [], low, task.advance)
        finally:
            model.to("cpu")
    sensitivity.write(name, measured, record)
    return _choose(measured, spec, low, high, rep), {**record, "cache": "written", "cache_key": name}, None


def _choose(measured: list[mixed.Unit], spec: Any, low: mixed.Precision, high: mixed.Precision,
            rep: Any) -> list[mixed.Unit]:
    """The groups at 8 bits for the spec's target, said in one line."""
    chosen = mixed.choose(measured, spec.target_bits, low, high)
    raised = [u for u in chosen if u.bits == mixed.HIGH_BITS]
    rep.log(f"bits plan: {len(raised)} of {len(chosen)} layer groups at {high.name} "
            f"({mixed.planned_bits(chosen, low, high):.3f} bits per weight planned, target {spec.target_bits:g}); "
            f"estimated KLD {sum(u.kld for u in chosen if u.bits == mixed.LOW_BITS):.4f} instead of "
            f"{sum(u.kld for u in chosen):.4f} with every group at {low.name}")
    return chosen


# Scales, zero points and per-tensor scales on top of the values' bits, at most: 0.5 bits per weight of NVFP4's 4
# (its FP8 scale per 16), 0.125 of int4 in groups of 128, less per channel.
_SCALE_OVERHEAD = 1.1


def _stored_bits(spec: Any) -> float:
    """Bits per quantized weight as the checkpoint stores them, an upper bound: a bits target is counted so already
    (scales included), and the run fails when the files are more than :data:`quantkit.producers.mixed.TOLERANCE`
    above it; otherwise the values' width (W4A8: int4 weights, its 8 bits are the activations') plus the scales."""
    target = getattr(spec, "target_bits", None)
    if target is not None:
        return target + mixed.TOLERANCE
    bits = 4 if spec.method == Method.W4A8 else getattr(spec, "bits", 8)
    return bits * _SCALE_OVERHEAD


def calibration_read(spec: Any, settings: CalibrationSpec) -> CalibrationSpec:
    """The calibration a spec reads, so that what is tokenized, recorded in the manifest and shown by the summary and
    ``--dry-run`` is what was read: the recipe's, or where only a bits target's sensitivity pass reads data (its
    method is round-to-nearest), the samples that hold its first :data:`quantkit.producers.mixed.SENSITIVITY_TOKENS`
    tokens (4 of 512 by default, not the 128 a calibrating method reads). An AutoRound batch larger than the
    samples is refused here, before anything loads (:func:`quantkit.producers.modifiers.autoround_batch`)."""
    autoround_batch(spec, settings.samples)
    if getattr(spec, "target_bits", None) is None or plan(spec.model_copy(update={"target_bits": None})).calibrate:
        return settings
    needed = -(-mixed.SENSITIVITY_TOKENS // settings.seq_len)
    return settings.model_copy(update={"samples": needed}) if settings.samples > needed else settings


class CompressedProducer:
    """The ``awq``, ``gptq``, ``autoround``, ``fp8``, ``int8``, ``w4a8``, ``rtn``, ``nvfp4`` and ``mxfp4`` methods."""

    def check(self, spec: Any, source: SourceModel) -> Checked:
        """Refuse before anything loads what cannot be made here; returns what it decided (the group choice, FP4's
        layers kept for their width), which the build carries to :meth:`produce` as ``ctx.checked``."""
        archs = source.config.get("architectures") or []
        if not vision.family(source.config) and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
            from quantkit.architectures import TABLE

            known = ", ".join(a.name for a in TABLE if a.vision)
            raise SourceModelError(
                f"{source.spec} is a {', '.join(archs) or 'model without architectures'}; "
                f"`quantkit {spec.method}` quantizes causal language models (…ForCausalLM) and the vision-language "
                f"families of its architecture table ({known})",
                hint="check config.json's architectures; another vision-language family needs a row in "
                     "quantkit/architectures.py naming its vision parts (DESIGN.md: adding an architecture)")
        choice = group_choice(spec, source)
        check_tiles(spec, source)
        ignore = ignore_mod.effective(spec, source)  # a misspelt --ignore fails here, before anything loads
        check_ignore(spec, source, ignore)  # nothing left, an MoE expert kept, part of a fused group kept
        narrow = narrow_layers(spec, source, ignore)  # FP4: nothing (or an expert) left to quantize fails here
        if getattr(spec, "target_bits", None) is not None:
            _check_target_bits(choice.apply(spec) if choice is not None else spec, source)
        return Checked(choice, narrow)

    def estimate_bytes(self, spec: Any, source: SourceModel) -> int:
        """The artifact's size on disk, before anything loads (``--dry-run`` and the free-space check): the
        embeddings and lm_head in bf16, every other weight at :func:`_stored_bits`, and the tokenizer files copied
        from the source (half a megabyte for a Llama-3 or SmolLM2 tokenizer: 4% of the reference model's artifact)."""
        tokenizer = sum(f.stat().st_size for f in source.path.glob("tokenizer*") if f.is_file())
        return _unquantized(source) * 2 + self.quantized_bytes(spec, source) + tokenizer

    def quantized_bytes(self, spec: Any, source: SourceModel) -> int:
        """The quantized weights' share of :meth:`estimate_bytes`: every weight but the embeddings and lm_head, at
        :func:`_stored_bits`. Compression builds them in the process's own memory beside the model (the plan's host
        memory, :func:`quantkit.plan._memory`); the embeddings and lm_head are saved as they are."""
        params = source.num_parameters or source.size_bytes // 2
        return int(max(params - _unquantized(source), 0) * _stored_bits(spec) / 8)

    def produce(self, ctx: ProduceContext) -> Produced:
        ctx = dataclasses.replace(ctx, calibration=calibration_read(ctx.spec, ctx.calibration))
        spec, rep = autoround_batch(ctx.spec, ctx.calibration.samples), ctx.reporter
        checked: Checked = ctx.checked
        choice = checked.choice
        notes: list[str] = []
        if spec is not ctx.spec:  # the default batch lowered to the samples: what AutoRound runs, and records
            notes.append(f"AutoRound's batch: {spec.batch_size}, the {ctx.calibration.samples} calibration samples "
                         "(its default 8 is more than there are)")
        if choice is not None:
            spec = choice.apply(spec)
            if choice.changed:
                notes.append(choice.reason)
                if choice.symmetric is None:  # the default did not fit the model: a warning
                    rep.warn(f"{choice.reason} (--group-size chooses another)")
                else:  # a default chosen for the bits target: its reason names the flags
                    rep.log(choice.reason)
        p = plan(spec)
        if getattr(spec, "target_bits", None) is not None and ctx.runtime.num_gpus > 1:
            raise UsageError("--target-bits measures and quantizes in one process",
                             hint="drop --num-gpus (the model is quantized one layer at a time on one GPU anyway)")
        job = Job.of(ctx, spec)
        if checked.narrow:
            notes.append(narrow_note(spec, checked.narrow))
            rep.warn(notes[-1])
            job = job.model_copy(update={"ignore": job.ignore + list(checked.narrow)})
        with rep.timed("setup"):  # importing torch and transformers, starting CUDA, the tokenizer
            device = oneshot.pin_device(ctx.runtime.device, ctx.runtime.num_gpus)
            tokenizer = load_tokenizer(ctx.source.path, trust_remote_code=job.trust_remote_code)
        calib = ctx.calibration_set(tokenizer) if p.calibrate else None
        job = job.model_copy(update={"samples": calib.samples if calib else None,
                                     "images": _calibration_images(ctx, calib) if calib and ctx.calibration.images
                                     else None})
        description = f"Quantizing {spec.method} ({p.scheme}) with llm-compressor on {device}"
        if ctx.runtime.num_gpus > 1:
            with rep.step("quantize", description + f" x{ctx.runtime.num_gpus} (torchrun)"):
                info = torchrun.distributed(job, ctx.runtime.num_gpus)
        else:
            with rep.step("load_model", f"Loading {ctx.source.spec}"), oneshot.quiet_backend():
                model = oneshot.load_model(job)
            bits_plan = None
            if getattr(spec, "target_bits", None) is not None:
                bits_plan, measurement, cached = _bits_plan(model, job, device, rep, ctx.source, calib.tokens_sha256)
                notes += [cached] if cached else []
                p = plan(spec, {b: mixed.targets(bits_plan, b) for b in (mixed.LOW_BITS, mixed.HIGH_BITS)})
                description = f"Quantizing {spec.method} ({p.scheme}) with llm-compressor on {device}"
            with rep.layers("quantize", description), oneshot.quiet_backend():
                info = oneshot.run(model, p, job, tokenizer)
            with rep.step("check", "Checking that every module that should be quantized was"):
                info["coverage"] = oneshot.check(model, p, job)
                if bits_plan is not None:
                    mixed.check_bits(model, bits_plan, *mixed.precisions(spec))
            with rep.step("save", "Saving the compressed-tensors checkpoint"), oneshot.quiet_backend():
                oneshot.save(model, tokenizer, job, p.save_format)
            del model
            if bits_plan is not None:
                achieved = mixed.measured_bits(ctx.workdir, bits_plan)
                mixed.verify(achieved, spec.target_bits, mixed.planned_bits(bits_plan, *mixed.precisions(spec)))
                info["mixed"] = mixed.manifest(bits_plan, spec.target_bits, achieved, *mixed.precisions(spec),
                                               measurement)
                rep.log(f"bits per weight of the quantized layers: {achieved:.3f} (target {spec.target_bits:g})")
        vl = vision.family(ctx.source.config)
        if vl is not None:
            with rep.step("check_vision", "Checking that the vision tower and projector are as the source has them"):
                vision.copy_processor(ctx.source.path, ctx.workdir)
                info["vision"] = vision.check_kept(ctx.source, ctx.workdir, vl)
            rep.log(f"kept as the source has them: {', '.join(vl.keep)} ({info['vision']['tensors']} tensors, "
                    f"{info['vision']['parameters'] / 1e6:.1f}M parameters, {'/'.join(info['vision']['dtypes'])})")
        tokens = (info.get("moe") or {}).get("expert_tokens")
        warning = moe.low_token_warning(tokens, "llm-compressor calibrated them on tokens routed elsewhere, so their "
                                                "scales may not fit what they see in use") if tokens else None
        if warning:
            rep.warn(warning)
            info["notes"].append(warning)
        quantization = oneshot.describe(ctx.workdir, p, info, job.ignore) | (choice.manifest() if choice else {})
        return Produced(quantization=quantization, calibration=calib, notes=notes + list(info.get("notes", [])))


def _unquantized(source: SourceModel) -> int:
    """The parameters left in bf16: the embeddings and, unless tied to them, lm_head."""
    cfg = text_config(source.config)
    vocab, hidden = int(cfg.get("vocab_size") or 0), int(cfg.get("hidden_size") or 0)
    return vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)


PRODUCER = CompressedProducer()


def _calibration_images(ctx: ProduceContext, calib: Any) -> list[str]:
    """The image files of an image+text calibration (recorded with their sha256 in the calibration's manifest). A
    model that takes no images was refused before anything loaded (:func:`quantkit.calibration.check_images`); a
    method that reads no calibration data was warned that the flag is not used (:func:`quantkit.plan.prepare`)."""
    from quantkit import images

    if ctx.runtime.num_gpus > 1:
        raise UsageError("--calib-images calibrates in one process", hint="drop --num-gpus")
    calib.pictures = images.load(images.folder(ctx.calibration.images))
    return [str(pic.path) for pic in calib.pictures]
