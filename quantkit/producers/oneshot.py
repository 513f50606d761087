"""The run: the source loaded with transformers, llm-compressor's ``oneshot`` on it, the coverage check and the
compressed-tensors save, and the manifest's ``quantization`` section read back from what was written.

The same functions serve the in-process path (:mod:`quantkit.producers.compressed`) and each torchrun rank
(:mod:`quantkit.producers.torchrun`).

* AWQ smoothing mappings are not ours: llm-compressor picks them from the architecture (its registry, falling
  back to its Llama-style defaults), and the manifest records them with the number of modules each was applied to.
* Mixture-of-experts models use llm-compressor's own MoE support: its linear experts (one Linear per expert
  projection) are built at load from a checkpoint that stores one tensor per expert, or replace transformers 5's
  fused 3-D experts right after loading one that stores them fused, one block at a time; and
  ``moe_calibrate_all_experts`` runs every expert on every calibration token. Routers and shared-expert gates are
  never quantized; the real router's choices are counted per expert, and :mod:`quantkit.producers.moe` knows each
  family (see there).

Tested with llmcompressor 0.14.0.1, compressed-tensors 0.19.0, auto-round 0.15.1, transformers 5.17.0, torch 2.13.0
(CPU).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from quantkit import source
from quantkit.errors import BackendError, SourceModelError, UsageError
from quantkit.producers import coverage, moe, vision
from quantkit.producers.job import Job
from quantkit.producers.modifiers import Plan
from quantkit.producers.patches import awq_resolved, awq_without_pin_memory

# Weights in files of at most 1 GB (transformers 5 writes one file up to 50 GB), each resumable on its own: a shard
# finished while the next is written is hashed and fsynced meanwhile (quantkit.seal), so what an artifact waits for
# after the save is the last shard or two, one hashing thread each. With 4 GB shards that wait was 4.4 s for the 8B
# GPTQ artifact and 5.6 s for FP8 on the H200 host (a 4 GB file hashed at about 1 GB/s by one thread,
# bench/results/h200/8b/); 1 GB shards bound it near 1 s, and loaders (transformers, vLLM) take any number of them.
SHARD_SIZE = "1GB"
LOAD_REPORT_LOGGER = "transformers.modeling_utils"  # where transformers 5 logs its load report


class _HeldReport(logging.Filter):
    """transformers' load report (a table of missing and unexpected tensors, on its logger), held back while
    quantkit checks the same lists: where they make quantkit refuse the checkpoint, its one error line is the whole
    message (the report above it was a screenful saying the same); where the load goes on, the report is logged."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.held.append(record)
            return False
        return True

    def release(self) -> None:
        for record in self.held:
            logging.getLogger(record.name).handle(record)
        self.held.clear()


@contextlib.contextmanager
def _load_report_held() -> Iterator[_HeldReport]:
    log = logging.getLogger(LOAD_REPORT_LOGGER)
    held = _HeldReport()
    log.addFilter(held)
    try:
        yield held
    finally:
        log.removeFilter(held)


@contextlib.contextmanager
def quiet_backend() -> Iterator[None]:
    """Silence library bars (:func:`quantkit.progress.silence_library_bars`) and torch.fx's one-line notice about
    llm-compressor's graph tracing while quantkit's own progress runs."""
    import logging

    from quantkit.progress import silence_library_bars

    silence_library_bars()
    fx_log = logging.getLogger("torch.fx._symbolic_trace")
    fx_level = fx_log.level
    fx_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        fx_log.setLevel(fx_level)


def pin_device(device: str, num_gpus: int) -> str:
    """Make llm-compressor compute where the recipe says.

    llm-compressor 0.14 has no device argument: it always computes on the first visible accelerator
    (``llmcompressor.utils.dev.get_main_device``). So ``cpu`` and ``cuda:N`` are honoured by what this process
    can see, set through CUDA_VISIBLE_DEVICES before CUDA initialises (quantkit touches CUDA nowhere earlier).
    """
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif device.startswith("cuda:"):
        index = device.split(":", 1)[1]
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or None
        if not index.isdigit() or (visible is not None and int(index) >= len(visible)):
            raise UsageError(f"--device {device}: no such GPU", hint="nvidia-smi lists them; or use --device auto")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[int(index)] if visible else index
    import torch

    gpus = torch.cuda.device_count()
    if device == "cpu" and gpus:
        raise UsageError("--device cpu: CUDA was already initialised in this process, so GPUs cannot be hidden",
                         hint="run with CUDA_VISIBLE_DEVICES= set in the environment instead")
    if device.startswith("cuda") and not gpus:
        raise UsageError(f"--device {device}: no CUDA GPU is visible", hint="use --device cpu (slow) or auto")
    if num_gpus > 1 and gpus < num_gpus:
        raise UsageError(f"--num-gpus {num_gpus}: only {gpus} CUDA GPU(s) visible",
                         hint=f"use --num-gpus {max(gpus, 1)}")
    return "cuda" if gpus else "cpu"


def _quiet_llmcompressor_log() -> None:
    """llm-compressor's INFO/WARNING/METRIC lines (one per module for GPTQ) and auto-round's (two per layer) drown
    quantkit's progress, and they go to stdout, which ``--json`` keeps for its one document;
    LLM_COMPRESSOR_LOG_LEVEL=INFO and AR_LOG_LEVEL=INFO show them. Read when llmcompressor is first imported, so this
    runs before every import of it."""
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")
    os.environ.setdefault("AR_LOG_LEVEL", "ERROR")  # auto-round's own per-layer lines; read when it is imported


def load_model(job: Job, distributed: bool = False) -> Any:
    """The source model on the CPU (the pipelines move layers to the accelerator as they go), experts linearized.

    A checkpoint whose headers hold one tensor per expert (the hub's Qwen-MoE and DeepSeek) of a family
    llm-compressor can load that way is built straight into its per-expert Linears
    (:func:`quantkit.producers.moe.load_linearized`): the plain load would stack every layer's experts into new
    3-D tensors for :func:`quantkit.producers.moe.linearize` to copy apart again (Qwen3-30B-A3B's shape on an H100:
    a 78.5 s load, 364 s in all against 303 s for llm-compressor's own script, 56.5 against 29.6 GiB peak
    anonymous host memory; on 2 of its layers on a CPU, 13.0 s against 0.9 s: bench/results/moe_load_*.md).
    Not llm-compressor's ``load_context`` as it is: its MoE half would fill nothing from a checkpoint that stores
    fused 3-D experts, leaving them at random with only transformers' load report to say so, and it drops the
    loading info; here a fused checkpoint (and every other load) takes the plain load, then
    :func:`quantkit.producers.moe.linearize`, one block at a time so the experts are never held twice. Either way a
    weight the checkpoint lacks is an error, never a random initialisation, and so is a tensor it holds that the
    model as built does not use (:func:`quantkit.source.check_unused`: transformers would drop it with a report on
    stderr only). Under torchrun the load gives no such report; :func:`quantkit.source.vet` checked the decoder
    layers from the headers before.
    """
    _quiet_llmcompressor_log()
    import torch
    import transformers

    # A vision-language checkpoint loads as the class it names (its language model, vision tower and projector).
    auto = transformers.AutoModelForImageTextToText if vision.family(job.config) else \
        transformers.AutoModelForCausalLM
    dtype = job.dtype
    kwargs: dict[str, Any] = {"dtype": "auto" if dtype == "auto" else getattr(torch, dtype),
                              "trust_remote_code": job.trust_remote_code}
    try:
        if distributed:
            from compressed_tensors.offload import load_offloaded_model

            with load_offloaded_model():
                model = auto.from_pretrained(job.source, device_map="auto_offload", **kwargs)
        else:
            with _load_report_held() as report:
                loaded = None
                per_expert = moe.per_expert_checkpoint(source.tensor_names(Path(job.source)))
                if moe.loads_per_expert(job.config, per_expert, job.trust_remote_code):
                    loaded = moe.load_linearized(auto, job.source, str(job.config.get("model_type")), **kwargs)
                model, info = loaded or auto.from_pretrained(job.source, output_loading_info=True, **kwargs)
            missing = sorted(info.get("missing_keys") or [])
            if missing:
                raise SourceModelError(
                    f"{job.source}: {len(missing)} weights the model needs are not in the checkpoint "
                    f"(transformers would initialise them at random): {', '.join(missing[:6])}"
                    + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else ""),
                    hint="the checkpoint's tensor names do not match its config.json's architecture")
            source.check_unused(job.source, info.get("unexpected_keys") or [], job.config)
            report.release()
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # RuntimeError: a checkpoint it cannot convert
        raise SourceModelError(
            f"transformers cannot load {job.source}: {str(e).splitlines()[0][:300]}",
            hint="check that the checkpoint is a complete causal LM (config.json + weights)") from None
    return moe.linearize(model)


def _matching(pattern: str, names: list[str]) -> int:
    """How many module names a compressed-tensors target matches (``re:`` a regular expression, else the name)."""
    import re

    if pattern.startswith("re:"):
        return sum(1 for n in names if re.match(pattern[3:], n))
    return sum(1 for n in names if n == pattern or n.endswith("." + pattern))


def run(model: Any, p: Plan, job: Job, tokenizer: Any | None = None) -> dict[str, Any]:
    """Run llm-compressor's oneshot on a loaded model; returns what the manifest should know about the run."""
    _quiet_llmcompressor_log()
    import torch
    from llmcompressor import oneshot

    torch.manual_seed(job.seed)
    modifiers = p.build(job.ignore)
    notes: list[str] = []
    for m in modifiers:
        if type(m).__name__ == "AutoRoundModifier":
            # llm-compressor's default compiles the tuning loop: about 20% faster on a GPU by auto-round's account,
            # while on a CPU compiling each layer's shapes costs more than it saves, and needs a C compiler.
            m.enable_torch_compile = torch.accelerator.is_available()
            notes.append(f"AutoRound's tuning loop {'compiled' if m.enable_torch_compile else 'not compiled'} with "
                         f"torch.compile ({'an' if m.enable_torch_compile else 'no'} accelerator)")
    kwargs: dict[str, Any] = {"moe_calibrate_all_experts": True}
    samples = job.samples
    if samples and job.images:
        from torch.utils.data import DataLoader

        from quantkit import images

        pictures = images.load(Path(job.images[0]).parent)
        pictures = [pic for pic in pictures if str(pic.path) in job.images]
        kwargs["dataset"] = DataLoader(vision.image_samples(Path(job.source), samples, pictures, job.seq_len),
                                       batch_size=1, collate_fn=lambda batch: batch[0])
    elif samples:
        from datasets import Dataset

        kwargs |= {"dataset": Dataset.from_dict({"input_ids": samples}), "num_calibration_samples": len(samples),
                   "max_seq_length": job.seq_len, "shuffle_calibration_samples": False}
    scoped: list[str] = []
    if vision.family(job.config):
        scoped = vision.scope_modifiers(modifiers, model)
    # The samples are token ids already; without a processor oneshot loads the checkpoint's own a second time (and,
    # for a vision-language model, image and video processors that may need torchvision only to be thrown away).
    if tokenizer is None:
        tokenizer = source.load_tokenizer(job.source, trust_remote_code=job.trust_remote_code)
    kwargs["processor"] = tokenizer
    fam = moe.family(job.config)
    split = _split_awq_router(modifiers, model, fam, job.config)
    # Under torchrun each rank routes only its share of the samples: counted in one process only.
    counted = fam and samples and not torch.distributed.is_initialized()
    router = moe.RouterTokens(model, fam, job.config, sum(map(len, samples))) if counted else None
    try:
        with awq_without_pin_memory(p), awq_resolved(p) as resolved, router or contextlib.nullcontext():
            oneshot(model=model, recipe=modifiers, **kwargs)
    except torch.OutOfMemoryError as e:
        raise BackendError(f"out of GPU memory while quantizing: {str(e).splitlines()[0][:200]}",
                           hint="lower --samples or --seq-len, or use --num-gpus N") from None
    except (ValueError, RuntimeError, AttributeError, TypeError, KeyError, AssertionError) as e:
        # AssertionError: llm-compressor states some of its preconditions as asserts (fused layers' observers)
        said = (str(e) or "no message").splitlines()[0][:400]  # a bare assert has no message
        raise BackendError(f"llm-compressor failed ({type(e).__name__}): {said}",
                           hint="rerun with --debug for the traceback") from e
    info: dict[str, Any] = {"notes": notes}
    if fam:
        info["moe"] = {"family": fam.name, "experts": fam.num_experts(job.config),
                       "top_k": fam.top_k(job.config), "layers": fam.layers(job.config),
                       "routers": moe.router_patterns(job.config), "calibrate_all_experts": True,
                       "expert_tokens": router.summary(job.min_expert_tokens) if router else None}
    for m in modifiers:
        if type(m).__name__ == "AWQModifier":
            info["awq_mappings"] = [{"smooth_layer": mp.smooth_layer, "balance_layers": list(mp.balance_layers),
                                     "applied_to": _matching(mp.smooth_layer, resolved)}  # smooth modules
                                    for mp in (m.mappings or [])]
            unused = [f"{mp['smooth_layer']} -> {', '.join(mp['balance_layers'])}" for mp in info["awq_mappings"]
                      if mp["applied_to"] == 0]
            if unused:
                info["notes"].append(f"AWQ mappings llm-compressor applied in no layer ({'; '.join(unused)}): it skips "
                                     "a layer where the smooth layer's outputs are not the balance layers' inputs "
                                     "(v_proj -> o_proj with fewer key-value heads than heads)")
            info["awq_mappings_source"] = _awq_mapping_source(model) + (
                ", its router mapping split into MoE and dense layers by quantkit" if split else "") + (
                ", each scoped to the language model by quantkit" if "AWQModifier" in scoped else "")
            info["notes"].append(f"AWQ smoothing mappings chosen by llm-compressor: {info['awq_mappings_source']}")
            if not torch.accelerator.is_available():
                info["notes"].append("AWQ on CPU: llm-compressor 0.14's activation pinning skipped (no accelerator)")
        if type(m).__name__ == "SmoothQuantModifier":
            info["smoothquant_mappings"] = [[list(b), s] for b, s in (m.mappings or [])]
            if "SmoothQuantModifier" in scoped:
                info["notes"].append("SmoothQuant mappings: llm-compressor's for the architecture, each scoped to the "
                                     "language model by quantkit")
    return info


def _split_awq_router(modifiers: list[Any], model: Any, fam: moe.Family | None, config: dict[str, Any]) -> bool:
    """Give AWQ mappings that work on an MoE with dense layers (:func:`quantkit.producers.moe.awq_mappings`);
    whether they differ from llm-compressor's own."""
    awq = next((m for m in modifiers if type(m).__name__ == "AWQModifier"), None)
    mappings = moe.awq_mappings(model, fam, config) if awq is not None and fam else None
    if mappings is not None:
        awq.mappings = mappings
    return mappings is not None


def _awq_mapping_source(model: Any) -> str:
    from llmcompressor.modifiers.transform.awq import AWQ_DYNAMIC_MAPPING_REGISTRY, AWQ_MAPPING_REGISTRY

    name = type(model).__name__
    if name in AWQ_DYNAMIC_MAPPING_REGISTRY or name in AWQ_MAPPING_REGISTRY:
        return f"its registry entry for {name}"
    return f"its default (Llama-style) mappings: {name} is not in its registry"


def save(model: Any, tokenizer: Any | None, job: Job, save_format: str | None = None) -> None:
    """compressed-tensors weights + config, the tokenizer, the generation config (save_pretrained writes it) and, for
    a vision-language model, the record of what stayed unquantized; an MoE's experts under its checkpoints' own
    names; ``save_format`` when compressed-tensors would infer the wrong one (W4A8).

    The one save of both paths: under torchrun every rank calls it, since every rank takes part in the weights' save
    (compressed-tensors gathers them and rank 0 writes); ``tokenizer`` is None on the other ranks, which write
    nothing else."""
    import warnings

    out = Path(job.out)
    fam = moe.family(job.config)
    if fam:
        moe.save_as_checkpoint(model, fam)
    with warnings.catch_warnings():  # transformers warns about 50 GB shards whenever llm-compressor offloaded modules
        warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
        model.save_pretrained(str(out), save_compressed=True, quantization_format=save_format,
                              max_shard_size=SHARD_SIZE)
    if tokenizer is None:
        return
    tokenizer.save_pretrained(str(out))
    if vision.family(job.config):
        vision.record_ignored(out, model, job.ignore)


def check(model: Any, p: Plan, job: Job) -> dict[str, Any]:
    """Every module that should be quantized was, with usable scales (:mod:`quantkit.producers.coverage`): raises
    (exit 1, nothing published) otherwise; returns the manifest's ``coverage``."""
    cov = coverage.check(model, job.ignore, job.config, p.signed_scales)
    cov.raise_for_failures()
    return cov.manifest()


def describe(out: Path, p: Plan, info: dict[str, Any], ignore: list[str]) -> dict[str, Any]:
    """The manifest's ``quantization`` section, read back from what was written."""
    from quantkit import versions

    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        raise BackendError(f"llm-compressor wrote no compressed-tensors quantization_config into {out}/config.json")
    q: dict[str, Any] = {"scheme": p.scheme, **p.summary, "ct_format": qc.get("format"),
                         "quant_method": qc.get("quant_method"), "ignore": qc.get("ignore", []),
                         "ignore_patterns": ignore, "kv_cache_scheme": qc.get("kv_cache_scheme"),
                         "recipe": p.recipe(ignore),
                         "llmcompressor": versions.version("llmcompressor"),
                         "compressed_tensors": versions.version("compressed-tensors")}
    if "awq_mappings" in info:
        q["awq_mappings"] = info["awq_mappings"]
        q["awq_mappings_source"] = info["awq_mappings_source"]
    if "smoothquant_mappings" in info:
        q["smoothquant_mappings"] = info["smoothquant_mappings"]
    if any(name == "AutoRoundModifier" for name, _ in p.modifiers):
        q["auto_round"] = versions.version("auto-round")
    for key in ("coverage", "moe", "mixed", "vision"):
        if key in info:
            q[key] = info[key]
    return q
