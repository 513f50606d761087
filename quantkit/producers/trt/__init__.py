"""TensorRT-LLM: ModelOpt quantization and export (step 1), then ``trtllm-build`` where it exists (step 2).

Step 1 runs ModelOpt (``modelopt.torch.quantization``) in its own Python environment (see :mod:`.pyenv`), as the
subprocess :mod:`.worker`, on calibration token ids built here by quantkit's own loader. It writes, inside the
artifact folder::

    hf/            the unified Hugging Face checkpoint (hf_quant_config.json where it is quantized: :func:`hf_kind`,
                   + the tokenizer): TensorRT-LLM's LLM API, vLLM (quantization="modelopt") and SGLang load it
    trtllm-ckpt/   the TensorRT-LLM checkpoint (config.json + rank{N}.safetensors, one per tp x pp rank), the
                   input of trtllm-build
    engine/        step 2's engine (rank{N}.engine + the tokenizer), only where TensorRT-LLM <= 1.2 is installed

Transformers must never be used to check these exports: it does not understand ``quant_method: modelopt`` and
loads FP8/INT8 weights silently wrong (scales dropped).

Tested with nvidia-modelopt 0.47.0, torch 2.13.0 (CPU), transformers 5.14.1 in the ModelOpt environment and
transformers 5.17.0 (tokenizer only) in quantkit's; step 2 is untested here (TensorRT-LLM needs NVIDIA's index).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from quantkit import ignore as ignore_mod
from quantkit.architectures import TRT_DECODERS
from quantkit.errors import BackendError, RecipeError, SourceModelError
from quantkit.formats.names import KindName
from quantkit.formats.specs import TrtSpec
from quantkit.producers.base import ProduceContext, Produced
from quantkit.producers.trt import engine, pyenv, runner
from quantkit.producers.trt.worker import HF_KV_CACHES
from quantkit.source import SourceModel

HF_DIR, CKPT_DIR, ENGINE_DIR = "hf", "trtllm-ckpt", "engine"
AWQ_GROUP = 128  # ModelOpt's INT4 AWQ presets quantize in groups of 128 input channels
NVFP4_GROUP = 16  # its NVFP4 presets (W4A4 and W4A16): FP4 values in blocks of 16 input channels, one FP8 scale each
# The quantizations whose weights are quantized in groups along each layer's input, and the group size: every width
# a layer reads (per tensor-parallel rank) must be a whole number of groups.
GROUPED = {"int4_awq": AWQ_GROUP, "w4a8_awq": AWQ_GROUP, "nvfp4": NVFP4_GROUP, "w4a16_nvfp4": NVFP4_GROUP}
# Rough artifact size per source byte for one checkpoint (linear weights shrink, embeddings and norms do not).
SIZE_RATIO = {"fp8": 0.55, "int8_sq": 0.55, "int4_awq": 0.35, "w4a8_awq": 0.35, "nvfp4": 0.33, "w4a16_nvfp4": 0.33,
              "none": 1.0}
# The quant_algo each quantization's export records (hf_quant_config.json, trtllm-ckpt/config.json; ModelOpt 0.47):
# what decides the engines that load it, said before it is made (``--dry-run``).
QUANT_ALGO = {"fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ",
              "nvfp4": "NVFP4", "w4a16_nvfp4": "W4A16_NVFP4", "none": None}
# Calibration batches hold about this many tokens (fake-quantized forward passes are cheaper batched).
BATCH_TOKENS = 4096
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "added_tokens.json")


def hf_kind(spec: TrtSpec) -> str:
    """The kind (:mod:`quantkit.formats.kinds`) of the hf/ folder the export will leave, foreseen from the spec for
    ``--dry-run``, which names the engine that kind's row gives: the run asks the same row of the folder it finds.
    ModelOpt 0.47 writes hf_quant_config.json, which makes hf/ a ModelOpt export, only where it records a quantization:
    of the weights (:data:`QUANT_ALGO`), or of the KV cache hf/ carries (the worker's ``HF_KV_CACHES``: FP8; an INT8
    one stays in trtllm-ckpt/). Else (``none``) hf/ is a plain Hugging Face checkpoint in the model's dtype."""
    quantized_kv = spec.kv_cache != "auto" and spec.kv_cache in HF_KV_CACHES
    return KindName.MODELOPT if QUANT_ALGO[spec.quantization] is not None or quantized_kv else KindName.HF


def _decoder(source: SourceModel) -> str:
    try:
        return TRT_DECODERS[source.architecture]
    except KeyError:
        raise SourceModelError(
            f"{source.spec} is {source.architecture}; the TensorRT-LLM export is tested for "
            f"{', '.join(TRT_DECODERS)} only", hint="use another method (awq, gptq, fp8, gguf) for this model") from None


class TrtProducer:
    """The producer registered for ``method: trt``."""

    def check(self, spec: TrtSpec, source: SourceModel) -> None:
        """Refuse, before any model loads, what ModelOpt's export or TensorRT-LLM's sharding cannot do."""
        _decoder(source)
        cfg = source.config
        heads = int(cfg.get("num_attention_heads", 0))
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size", 0)) // max(heads, 1)))
        inter = int(cfg.get("intermediate_size", 0))
        layers = int(cfg.get("num_hidden_layers", 0))
        bad = [f"{name} {n} is not divisible by tp={spec.tp}"
               for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                               ("intermediate_size", inter)) if n % spec.tp]
        if spec.pp > layers:
            bad.append(f"pp={spec.pp} is more than the {layers} layers")
        group = GROUPED.get(spec.quantization)
        if group:
            for name, n in (("hidden_size", int(cfg.get("hidden_size", 0))),
                            ("attention output input (heads x head_dim / tp)", heads * head_dim // spec.tp),
                            ("intermediate_size / tp", inter // spec.tp)):
                if n % group:
                    bad.append(f"{name} = {n} is not a multiple of the {spec.quantization} group size {group}")
        if bad:
            raise RecipeError(f"quantize: {spec.quantization} with tp={spec.tp}, pp={spec.pp} cannot shard "
                              f"{source.spec}: " + "; ".join(bad), hint="choose a smaller tp/pp")
        regex = [p for p in spec.ignore if p.startswith("re:")]
        if regex:
            raise RecipeError(f"quantize.ignore: {regex[0]!r}: ModelOpt matches module names with wildcards, not "
                              "regular expressions", hint="write e.g. 'model.layers.0.*' or '*mlp.down_proj'")
        ignore_mod.effective(spec, source, wildcards=True)  # a misspelt module fails here, before anything loads

    def estimate_bytes(self, spec: TrtSpec, source: SourceModel) -> int:
        """Two checkpoints (hf/ and trtllm-ckpt/), plus an engine of about the same size unless checkpoint-only."""
        copies = 2 if spec.checkpoint_only else 3
        return int(source.size_bytes * SIZE_RATIO[spec.quantization] * copies)

    def produce(self, ctx: ProduceContext) -> Produced:
        rep = ctx.reporter
        with rep.step("trt_environment", "Checking the ModelOpt environment"):
            env = pyenv.probe(ctx.runtime.python)
        rep.log(f"  ModelOpt {env.versions.get('nvidia-modelopt')} in {env.python} ({env.origin})")
        work = Path(tempfile.mkdtemp(prefix="quantkit-trt-"))
        try:
            produced, keep_work = self._produce(ctx, env, work)
        except BackendError:
            raise  # its message names the log, kept in the work folder
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        if not keep_work:
            shutil.rmtree(work, ignore_errors=True)
        return produced

    def _produce(self, ctx: ProduceContext, env: pyenv.TrtEnvironment, work: Path) -> tuple[Produced, bool]:
        """Step 1 in the ModelOpt environment, then step 2; also says whether the work folder holds a log that a
        note refers to (a failed engine build)."""
        spec: TrtSpec = ctx.spec
        # Absolute paths: the worker runs in its own work folder.
        hf_dir, ckpt_dir = (ctx.workdir / HF_DIR).resolve(), (ctx.workdir / CKPT_DIR).resolve()
        calib = None
        # Weights load (and export) in model.dtype (auto: the checkpoint's own), as every other method loads them.
        job: dict[str, Any] = {
            "model": str(Path(ctx.source.path).resolve()), "dtype": ctx.model.dtype,
            "trust_remote_code": ctx.model.trust_remote_code, "device": ctx.runtime.device,
            "seed": ctx.runtime.seed, "decoder_type": _decoder(ctx.source), "quantization": spec.quantization,
            "kv_cache": spec.kv_cache, "ignore": ignore_mod.effective(spec, ctx.source, wildcards=True),
            "batch_tokens": BATCH_TOKENS,
            "trtllm": {"dir": str(ckpt_dir), "tp": spec.tp, "pp": spec.pp}, "hf": {"dir": str(hf_dir)},
        }
        if spec.quantization != "none" or spec.kv_cache != "auto":
            calib = ctx.calibration_set(_tokenizer(ctx))
            job["calibration"] = str(work / "calibration.json")
            (work / "calibration.json").write_text(json.dumps(calib.samples))
        events = runner.run(env.python, job, work, ctx.reporter)
        _copy_tokenizer(ctx.source.path, hf_dir)
        trt_config = json.loads((ckpt_dir / "config.json").read_text())
        mapping = trt_config.get("mapping") or {}
        world = int(mapping.get("world_size", spec.tp * spec.pp))
        step2 = _engine_step(ctx, env, world, work)
        q = trt_config.get("quantization") or {}
        result = events["result"]
        quantization = {
            "scheme": spec.quantization,
            "quant_algo": q.get("quant_algo"),
            "kv_cache_quant_algo": q.get("kv_cache_quant_algo"),
            "hf_kv_cache": result.get("hf_kv_cache", spec.kv_cache),
            "group_size": q.get("group_size"),
            "exclude_modules": sorted(q.get("exclude_modules") or []),
            "tp": int(mapping.get("tp_size", spec.tp)), "pp": int(mapping.get("pp_size", spec.pp)),
            "world_size": world,
            "decoder_type": job["decoder_type"],
            "export_dtype": result.get("export_dtype"),
            "quantizers": result.get("quantizers"),
            "layout": {"hf": HF_DIR, "trtllm_checkpoint": CKPT_DIR,
                       "engine": ENGINE_DIR if step2.status in ("ran", "built") else None},
            "engine": step2.manifest(),
            "limits": spec.limits.model_dump(mode="json"),
            "modelopt_environment": env.manifest(),
        }
        notes = [step2.note]
        if quantization["hf_kv_cache"] != spec.kv_cache:
            notes.append(f"hf/ has a model-dtype KV cache: ModelOpt's unified export writes FP8 KV-cache scales only; "
                         f"the {spec.kv_cache.upper()} KV cache is in trtllm-ckpt/.")
        if step2.status == "failed":
            ctx.reporter.warn(step2.note)
        produced = Produced(quantization=quantization, calibration=calib, notes=notes)
        return produced, step2.status == "failed"


def _engine_step(ctx: ProduceContext, env: pyenv.TrtEnvironment, world: int, work: Path) -> engine.EngineStatus:
    """Step 2, or the reason it did not run. A failed build is recorded and its partial engine removed; step 1's
    checkpoints are kept (they may have taken hours)."""
    spec: TrtSpec = ctx.spec
    skipped = engine.status(env, spec.checkpoint_only, spec.limits, world)
    if skipped is not None:
        return skipped
    ckpt_dir, engine_dir = (ctx.workdir / CKPT_DIR).resolve(), (ctx.workdir / ENGINE_DIR).resolve()
    try:
        with ctx.reporter.step("engine_build", f"Building the TensorRT engine ({world} rank(s))"):
            cmd = engine.build(env, ckpt_dir, engine_dir, spec.limits, world, work / "trtllm-build.log")
        _copy_tokenizer(ctx.source.path, engine_dir)
        if world > 1:
            return engine.EngineStatus("built", f"Engine built for {world} ranks in {ENGINE_DIR}/; not run here "
                                       f"(it needs `mpirun -n {world}`).", cmd)
        run_dir = work / "engine-run"
        run_dir.mkdir()
        generated = engine.generate(env, engine_dir, _tokenizer(ctx), run_dir, ctx.reporter)
    except BackendError as e:
        shutil.rmtree(engine_dir, ignore_errors=True)
        return engine.EngineStatus("failed", f"Engine step failed: {e.message} ({e.hint})")
    return engine.EngineStatus("ran", f"Engine built in {ENGINE_DIR}/, loaded by TensorRT-LLM's runtime and "
                               f"generated {sum(g['tokens'] for g in generated)} tokens.", cmd, generated)


def _tokenizer(ctx: ProduceContext) -> Any:
    """The source's tokenizer, loaded here (quantkit's environment): calibration ids are made on this side."""
    from quantkit import versions

    with ctx.reporter.step("load_tokenizer", "Loading the tokenizer"):
        transformers = versions.require("transformers", "eval", "Tokenizing calibration data for the TensorRT-LLM step")
        return transformers.AutoTokenizer.from_pretrained(str(ctx.source.path),
                                                          trust_remote_code=ctx.model.trust_remote_code)


def _copy_tokenizer(source: Path, dest: Path) -> None:
    """The source's tokenizer files, byte for byte, so the exported folder serves on its own."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and not (dest / name).exists():
            shutil.copy2(source / name, dest / name)


PRODUCER = TrtProducer()
