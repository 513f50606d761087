"""The one table of formats: every method quantkit can make, as one :class:`Format` row each.

A row says everything the rest of quantkit needs to know about a method, so nothing else spells the list out:

* ``spec``: its recipe schema (a class in :mod:`.specs`), whose ``method:`` literal is the row's ``method``; the
  recipe's ``method:`` union is built from the rows;
* ``producer``: the module whose ``PRODUCER`` writes it (imported only when used);
* ``kind``: the artifact kind it leaves on disk (:mod:`.kinds`: how it is recognised, which engine evaluates it
  and which serves it, for ``inspect``, ``doctor``, ``eval`` and ``smoke``); a compressed-tensors row is made by
  llm-compressor (``llmcompressor``), so nothing compares producer modules;
* ``verb``, ``help``, ``examples``, ``flags``: its command line (``quantkit awq MODEL OUT --bits 4``), each flag
  a recipe field, plus the shared flag groups it uses (only those appear in ``--help``);
* ``calibrates``: whether a given spec reads calibration data (the reuse hash and ``--dry-run`` depend on it);
* ``folder``: the artifact's default folder name inside a multi-output release.

A method with more than one on-disk layout has one row per layout, selected by the spec's ``format`` field
(``layout``): AutoAWQ and GPTQ checkpoints are their own rows with their own producer. Adding a format is adding a
spec class, a row here and its producer module; DESIGN.md lists the steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quantkit.formats import kinds
from quantkit.formats.names import TEXT_FILES_SHOWN, KindName, Method
from quantkit.formats.specs import (DEFAULT_GROUP_SIZE, FP4_HIGH_HELP, FP4_OBSERVER_HELP, FP4_SCHEME_HELP,
                                   FP4_TARGET_BITS_HELP, AutoRoundSpec, AwqSpec, Fp4Spec, Fp8Spec, GgufSpec, GptqSpec,
                                   Int8Spec, Mxfp4Spec, Nvfp4Spec, RtnSpec, TrtSpec, W4a8Spec)


@dataclass(frozen=True)
class Flag:
    """One command-line flag: the recipe field it sets, its spelling and help. ``type`` is the value's Python type
    (``bool`` for on/off switches, ``list`` for repeatable flags)."""

    name: str
    decls: tuple[str, ...]
    type: Any
    field: str
    help: str
    panel: str | None = None

    @property
    def flag(self) -> str:
        """The flag as a user types it (the first spelling), for messages."""
        return self.decls[0].split("/")[0]


def _f(name: str, decl: str, type_: Any, field_: str, help_: str, panel: str | None = None) -> Flag:
    return Flag(name, tuple(decl.split(" ")), type_, field_, help_, panel)


# Shared flag groups; a format lists the ones it uses.
CALIBRATION = (
    _f("calib", "--calib", str, "calibration.dataset", "Calibration data: prose, code, mixed, heldout (the "
       f"evaluation text), a {TEXT_FILES_SHOWN} file, or a hub dataset (wikitext2, pile-val, c4, "
       "ultrachat, org/name\\[:config]\\[@split]) \\[default: mixed].", "Calibration"),
    _f("samples", "--samples", int, "calibration.samples", "Number of calibration samples \\[default: 128].",
       "Calibration"),
    _f("seq_len", "--seq-len", int, "calibration.seq_len", "Tokens per calibration sample \\[default: 512].",
       "Calibration"),
    _f("calib_field", "--calib-field", str, "calibration.field", "JSON/parquet field holding the text "
       "\\[default: text].", "Calibration"),
    _f("chat_template", "--chat-template/--no-chat-template", bool, "calibration.chat_template",
       "Render calibration samples with the model's chat template, each document as the assistant's reply "
       "\\[default: auto: for an instruct model, whose EOS ends the template's turns, with text-only "
       "calibration].",
       "Calibration"),
    _f("calib_images", "--calib-images", str, "calibration.images",
       "Vision-language models: calibrate on image+text samples, each text sample placed after an image and its "
       "question: shipped (calibration/images) or a folder of images \\[default: text only].", "Calibration"),
    _f("min_expert_tokens", "--min-expert-tokens", int, "calibration.min_expert_tokens",
       "Warn when the router sends a mixture-of-experts expert fewer calibration tokens than this "
       "\\[default: 16].", "Calibration"),
)
REVISION = (_f("revision", "--revision", str, "model.revision", "Hub branch, tag or commit of the source model.",
               "Model"),)
LOADING = (
    _f("dtype", "--dtype", str, "model.dtype", "Load dtype: auto, bfloat16, float16, float32.", "Model"),
    _f("trust_remote_code", "--trust-remote-code", bool, "model.trust_remote_code",
       "Allow the checkpoint's own Python code to run (off by default).", "Model"),
    _f("allow_pickle", "--allow-pickle", bool, "model.allow_pickle",
       "Accept pickle (.bin/.pt) weights (unsafe; off by default).", "Model"),
)
IGNORE = (_f("ignore", "--ignore", list, "quantize.ignore", "Also keep this module in full precision: a module name "
             "or re:REGEX that must match a module of the model (repeatable; added to the defaults).", "Model"),
          _f("default_ignore", "--default-ignore/--no-default-ignore", bool, "quantize.default_ignore",
             "Keep lm_head and mixture-of-experts router gates in full precision \\[default: on].", "Model"))
DEVICE = (_f("device", "--device", str, "runtime.device", "auto, cpu, cuda or cuda:N \\[default: auto].",
             "Runtime"),)
GPUS = (_f("num_gpus", "--num-gpus", int, "runtime.num_gpus",
           "GPUs for distributed calibration (launched through torchrun).", "Runtime"),)
SEED = (_f("seed", "--seed", int, "runtime.seed", "Seed for sampling calibration data and any randomness "
           "\\[default: 0].", "Runtime"),)
LLMCOMPRESSOR = CALIBRATION + IGNORE + REVISION + LOADING + DEVICE + GPUS + SEED

BITS = _f("bits", "--bits", int, "quantize.bits", "Weight bits: 4 or 8 \\[default: 4].")
GROUP = _f("group_size", "--group-size", int, "quantize.group_size",
           "Weights per quantization group: 32, 64, 128, 256 or -1 for per-channel \\[default: 128, or the largest "
           "of 64 and 32 that divides every layer's input width].")

TARGET_BITS = _f("target_bits", "--target-bits", float, "quantize.target_bits",
                 "Average bits per weight of the quantized layers, scales included (e.g. 5.5): each layer group's "
                 "4-bit KLD is measured on the calibration set and the costliest go to 8 bits until the average is "
                 "reached; the plan and the bits counted from the files go into the manifest \\[default: every "
                 "layer at --bits].")


@dataclass(frozen=True)
class Format:
    """One method (and on-disk layout) quantkit can make; see the module docstring for each field."""

    spec: type
    producer: str
    kind: str
    calibrates: Callable[[Any], bool]
    folder: Callable[[Any], str]
    verb: str | None = None
    help: str = ""
    examples: tuple[str, ...] = ()
    flags: tuple[Flag, ...] = ()
    layout: str | None = None

    @property
    def method(self) -> str:
        """The recipe's ``method:`` value, read from its spec's literal (a :class:`.names.Method` value)."""
        return self.spec.model_fields["method"].annotation.__args__[0]

    @property
    def llmcompressor(self) -> bool:
        """Whether llm-compressor makes it: every row that leaves a compressed-tensors checkpoint (its format; the
        legacy layouts are written beside one)."""
        return self.kind == KindName.COMPRESSED_TENSORS

    @property
    def key(self) -> str:
        """The row's name: the method, plus the layout for the extra layouts of a method (``awq+autoawq``)."""
        return f"{self.method}+{self.layout}" if self.layout else self.method


def _fp4_flags() -> tuple[Flag, ...]:
    """An FP4 verb's own flags: the same for NVFP4 and MXFP4, whose specs share one base class (its defaults said
    here as it sets them)."""
    return (_f("scheme", "--scheme", str, "quantize.scheme", FP4_SCHEME_HELP + " \\[default: w4a16]."),
            _f("algorithm", "--algorithm", str, "quantize.algorithm",
               "rtn (round-to-nearest), gptq (GPTQ with the FP4 scheme) or awq (AWQ smoothing, then round-to-nearest) "
               f"\\[default: {Fp4Spec.model_fields['algorithm'].default}]."),
            _f("observer", "--observer", str, "quantize.observer",
               "minmax or mse: llm-compressor's observer for the FP4 weight scales (memoryless_minmax, memoryless_mse) "
               f"\\[default: {FP4_OBSERVER_HELP}]."),
            _f("target_bits", "--target-bits", float, "quantize.target_bits",
               FP4_TARGET_BITS_HELP[0].upper() + FP4_TARGET_BITS_HELP[1:] + " (e.g. 5.5; the plan and the bits "
               "counted from the files go into the manifest)."),
            _f("high", "--high", str, "quantize.high", FP4_HIGH_HELP[0].upper() + FP4_HIGH_HELP[1:] + "."))


def _fp4_folder(spec: Any) -> str:
    mix = f"-b{spec.target_bits:g}{spec.high_precision}" if spec.target_bits is not None else ""
    return f"{spec.method}-{spec.scheme}-{spec.algorithm}{mix}"


def _int_folder(spec: Any) -> str:
    """``gptq-w4g128``: method, bits (or bits target) and group size. An unset group size is named after the default
    128 even where the source gets another (SmolLM2's 576-wide layers get 64; the manifest records the size used):
    names are made from the recipe alone, before the source is read or downloaded, so a rerun finds the folder it
    reuses and two outputs of one folder are refused when the recipe loads."""
    g = DEFAULT_GROUP_SIZE if spec.group_size is None else spec.group_size
    bits = f"b{spec.target_bits:g}" if getattr(spec, "target_bits", None) is not None else f"w{spec.bits}"
    return f"{spec.method}-{bits}g{g if g > 0 else 'ch'}"


FORMATS: tuple[Format, ...] = (
    Format(AwqSpec, "quantkit.producers.compressed", KindName.COMPRESSED_TENSORS, lambda s: True, _int_folder,
           verb="awq",
           help="AWQ int4 (W4A16, group 128, asymmetric) through llm-compressor: activation-aware scales, then group "
                "quantization. Writes a compressed-tensors checkpoint vLLM and transformers load.",
           examples=("quantkit awq models/quantkit-tiny out/awq",
                     "quantkit awq org/model out/awq --samples 256 --seq-len 1024 --format autoawq"),
           flags=(BITS, GROUP, TARGET_BITS,
                  _f("symmetric", "--symmetric/--asymmetric", bool, "quantize.symmetric",
                     "Symmetric quantization \\[default: asymmetric]."),
                  _f("format", "--format", str, "quantize.format",
                     "compressed-tensors, or autoawq to also write the legacy AutoAWQ GEMM layout."),
                  _f("offload_activations", "--offload-activations/--no-offload-activations", bool,
                     "quantize.offload_activations",
                     "Keep AWQ's cached layer inputs in host memory between grid-search passes: identical scales, "
                     "less GPU memory, much slower (8B on an H200: -16% GPU memory, +66% time); for a GPU that "
                     "runs out of memory \\[default: off]."),
                  *LLMCOMPRESSOR)),
    Format(AwqSpec, "quantkit.producers.legacy", KindName.COMPRESSED_TENSORS, lambda s: True, _int_folder,
           layout="autoawq"),
    Format(GptqSpec, "quantkit.producers.compressed", KindName.COMPRESSED_TENSORS, lambda s: True, _int_folder,
           verb="gptq",
           help="GPTQ int4/int8 (W4A16/W8A16, group 128, symmetric) through llm-compressor: second-order error "
                "compensation. Writes a compressed-tensors checkpoint.",
           examples=("quantkit gptq models/quantkit-tiny out/gptq",
                     "quantkit gptq org/model out/gptq --bits 8 --samples 512 --seq-len 2048 --format gptq"),
           flags=(BITS, GROUP, TARGET_BITS,
                  _f("symmetric", "--symmetric/--asymmetric", bool, "quantize.symmetric",
                     "Symmetric quantization \\[default: symmetric; with --target-bits 5.5 or more and no "
                     "--group-size, int4 in groups of 32 with zero points, which scored lowest at equal bits]. "
                     "--asymmetric adds zero points: vLLM 0.26 serves them for 4 bits (Marlin, Machete) but has no "
                     "kernel for asymmetric 8-bit weights, so a --target-bits mix keeps its 8-bit layers symmetric."),
                  _f("act_order", "--act-order/--no-act-order", bool, "quantize.act_order",
                     "GPTQ activation ordering: quantize columns in order of decreasing activation magnitude "
                     "(llm-compressor's static ordering: no g_idx, no runtime cost) \\[default: on]."),
                  _f("damp", "--damp", float, "quantize.damp", "Hessian dampening fraction \\[default: 0.01]."),
                  _f("imatrix", "--imatrix/--no-imatrix", bool, "quantize.imatrix",
                     "Choose each group's range by llm-compressor's importance-weighted MSE observer (error weighted "
                     "by each input channel's mean squared activation) instead of its min and max \\[default: on]."),
                  _f("awq", "--awq/--no-awq", bool, "quantize.awq",
                     "Smooth with AWQ first (llm-compressor's AWQModifier, duo scaling), then quantize with GPTQ "
                     "\\[default: off]."),
                  _f("format", "--format", str, "quantize.format",
                     "compressed-tensors, or gptq to also write the legacy GPTQ layout."),
                  *LLMCOMPRESSOR)),
    Format(GptqSpec, "quantkit.producers.legacy", KindName.COMPRESSED_TENSORS, lambda s: True, _int_folder,
           layout="gptq"),
    Format(AutoRoundSpec, "quantkit.producers.compressed", KindName.COMPRESSED_TENSORS, lambda s: True,
           _int_folder, verb="autoround",
           help="AutoRound int4/int8 (W4A16/W8A16, symmetric) through llm-compressor: each layer's rounding and "
                "clipping tuned by signed gradient descent against its full-precision output. Writes a "
                "compressed-tensors checkpoint vLLM and transformers load.",
           examples=("quantkit autoround models/quantkit-tiny out/autoround",
                     "quantkit autoround org/model out/autoround --iterations 500 --samples 256 --seq-len 2048"),
           flags=(BITS, GROUP,
                  _f("iterations", "--iterations", int, "quantize.iterations",
                     "Tuning steps per decoder layer \\[default: 200]."),
                  _f("batch_size", "--batch-size", int, "quantize.batch_size",
                     "Calibration samples per tuning step \\[default: 8]."),
                  _f("lr", "--lr", float, "quantize.lr", "Signed-gradient step size \\[default: 1/iterations]."),
                  *LLMCOMPRESSOR)),
    Format(Fp8Spec, "quantkit.producers.compressed", KindName.COMPRESSED_TENSORS,
           lambda s: s.scheme == "static" or s.kv_cache_fp8, lambda s: f"fp8-{s.scheme}",
           verb="fp8",
           help="FP8 E4M3 weights with their scale tensors (static, dynamic or 128x128 block scales), optionally "
                "FP8 KV cache. Writes a compressed-tensors checkpoint.",
           examples=("quantkit fp8 models/quantkit-tiny out/fp8",
                     "quantkit fp8 org/model out/fp8-dynamic --scheme dynamic"),
           flags=(_f("scheme", "--scheme", str, "quantize.scheme",
                     "static (per-tensor weight + calibrated input scales), dynamic (per-channel weights, per-token "
                     "activations at run time, no calibration), block (128x128 weight blocks) \\[default: static]."),
                  _f("kv_cache_fp8", "--kv-cache-fp8", bool, "quantize.kv_cache_fp8",
                     "Also calibrate FP8 KV-cache scales."),
                  *LLMCOMPRESSOR)),
    Format(Int8Spec, "quantkit.producers.compressed", KindName.COMPRESSED_TENSORS, lambda s: True,
           lambda s: f"int8-sq-{s.weights}",
           verb="int8",
           help="SmoothQuant, then W8A8 INT8 (per-channel weights, dynamic per-token activations) with GPTQ or "
                "round-to-nearest weights.",
           examples=("quantkit int8 models/quantkit-tiny out/int8",
                     "quantkit int8 org/model out/int8 --smoothing-strength 0.5 --weights rtn"),
           flags=(_f("smoothing_strength", "--smoothing-strength", float, "quantize.smoothing_strength",
                     "SmoothQuant migration strength alpha in (0, 1) \\[default: 0.8]."),
                  _f("weights", "--weights", str, "quantize.weights",
                     "gptq or rtn for the INT8 weights \\[default: gptq]."),
                  *LLMCOMPRESSOR)),
    Format(W4a8Spec, "quantkit.producers.compressed", KindName.COMPRESSED_TENSORS, lambda s: s.weights == "gptq",
           lambda s: f"w4a8-{s.weights}",
           verb="w4a8",
           help="W4A8 for Hopper GPUs: int4 weights (group 128, symmetric; GPTQ or round-to-nearest) with FP8 "
                "activations quantized per token at run time, through llm-compressor's W4AFP8 scheme. Writes a "
                "compressed-tensors checkpoint vLLM serves with its CUTLASS W4A8 kernel.",
           examples=("quantkit w4a8 models/quantkit-tiny out/w4a8", "quantkit w4a8 org/model out/w4a8 --weights rtn"),
           flags=(_f("weights", "--weights", str, "quantize.weights",
                     "gptq (calibrated) or rtn (no calibration) for the int4 weights \\[default: gptq]."),
                  *LLMCOMPRESSOR)),
    Format(RtnSpec, "quantkit.producers.compressed", KindName.COMPRESSED_TENSORS,
           lambda s: s.target_bits is not None, _int_folder,
           verb="rtn",
           help="Round-to-nearest W4A16/W8A16 with no calibration: the instant option, and the baseline AWQ and "
                "GPTQ must beat (with --target-bits, the first 2,048 tokens of the default calibration set measure "
                "each layer's sensitivity).",
           examples=("quantkit rtn models/quantkit-tiny out/rtn", "quantkit rtn org/model out/rtn-w8 --bits 8",
                     "quantkit rtn org/model out/rtn-mixed --target-bits 5.5"),
           flags=(BITS, GROUP, TARGET_BITS,
                  _f("symmetric", "--symmetric/--asymmetric", bool, "quantize.symmetric",
                     "Symmetric quantization \\[default: symmetric]."),
                  *IGNORE, *REVISION, *LOADING, *DEVICE, *SEED)),
    Format(Nvfp4Spec, "quantkit.producers.compressed", KindName.COMPRESSED_TENSORS, lambda s: s.calibrates,
           _fp4_folder, verb="nvfp4",
           help="NVFP4 through llm-compressor: FP4 E2M1 weights in groups of 16 with FP8 E4M3 scales and one FP32 "
                "global scale per tensor, weight-only (W4A16) or with FP4 activations (W4A4); round-to-nearest, GPTQ "
                "or AWQ. Writes a compressed-tensors nvfp4-pack-quantized checkpoint (vLLM: native FP4 on Blackwell, "
                "Marlin FP4 weight-only on Hopper and Ampere).",
           examples=("quantkit nvfp4 models/quantkit-tiny out/nvfp4",
                     "quantkit nvfp4 org/model out/nvfp4-w4a4 --scheme w4a4 --algorithm rtn --samples 64",
                     "quantkit nvfp4 org/model out/nvfp4-awq --algorithm awq --observer minmax"),
           flags=(*_fp4_flags(), *LLMCOMPRESSOR)),
    Format(Mxfp4Spec, "quantkit.producers.compressed", KindName.COMPRESSED_TENSORS, lambda s: s.calibrates,
           _fp4_folder, verb="mxfp4",
           help="MXFP4 through llm-compressor: FP4 E2M1 weights in groups of 32 with power-of-two E8M0 scales (OCP "
                "microscaling), weight-only (W4A16) or with FP4 activations (W4A4); round-to-nearest, GPTQ or AWQ. "
                "Writes a compressed-tensors mxfp4-pack-quantized checkpoint (vLLM: Marlin FP4 weight-only on Hopper "
                "and Ampere).",
           examples=("quantkit mxfp4 models/quantkit-tiny out/mxfp4",
                     "quantkit mxfp4 org/model out/mxfp4-rtn --algorithm rtn"),
           flags=(*_fp4_flags(), *LLMCOMPRESSOR)),
    Format(GgufSpec, "quantkit.producers.gguf", KindName.GGUF, lambda s: s.imatrix or s.target_bits is not None,
           lambda s: "gguf" if s.target_bits is None else f"gguf-b{s.target_bits:g}",
           verb="gguf",
           help="GGUF files for llama.cpp: convert once (F32/F16/BF16/Q8_0 written directly), then each --type "
                "through llama.cpp's own quantizer, with an importance matrix when asked (computed from the "
                "calibration set, or given).",
           examples=("quantkit gguf models/quantkit-tiny out/gguf -t Q8_0 -t Q4_K_M",
                     "quantkit gguf models/quantkit-tiny out/gguf-imat -t IQ4_XS -t IQ2_M --imatrix --samples 64",
                     "quantkit gguf org/model out/gguf -t Q4_K_M --imatrix-file model.imatrix.gguf"),
           flags=(_f("types", "--type -t", list, "quantize.types",
                     "GGUF type, repeatable: F32, F16, BF16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M, Q2_K, IQ4_XS, IQ3_M, "
                     "IQ2_M, IQ1_S ... (every type llama.cpp quantizes) \\[default: Q4_K_M]."),
                  _f("imatrix", "--imatrix/--no-imatrix", bool, "quantize.imatrix",
                     "Compute llama.cpp's importance matrix from the calibration set and quantize with it (needed by "
                     "IQ1_*, IQ2_*, IQ3_XXS, IQ3_XS, Q2_K_S)."),
                  _f("imatrix_file", "--imatrix-file", str, "quantize.imatrix_file",
                     "Quantize with this importance matrix (llama-imatrix's .gguf or legacy .dat)."),
                  _f("target_bits", "--target-bits", float, "quantize.target_bits",
                     "Average bits per weight of the transformer blocks' matrices (e.g. 5.5): the --type's own mix, "
                     "then the layer groups whose 4-bit KLD (measured on the calibration set) costs the most per "
                     "bit raised to Q8_0 until the average is reached \\[default: the type's mix as it is]."),
                  *CALIBRATION, *REVISION, *DEVICE, *SEED)),
    Format(TrtSpec, "quantkit.producers.trt", KindName.TENSORRT_LLM,
           lambda s: s.quantization != "none" or s.kv_cache != "auto", lambda s: f"trt-{s.quantization}",
           verb="build-trt"),
)


def methods() -> tuple[str, ...]:
    """Every recipe ``method:`` value, in table order."""
    return tuple(dict.fromkeys(f.method for f in FORMATS))


def specs() -> tuple[type, ...]:
    """Every method's spec class (one per method), for the recipe's discriminated union."""
    return tuple(dict.fromkeys(f.spec for f in FORMATS))


def by_method(method: str) -> Format:
    """A method's row (its default layout)."""
    return next(f for f in FORMATS if f.method == method and f.layout is None)


def verbs() -> tuple[Format, ...]:
    """The rows with a standard ``quantkit VERB MODEL OUTPUT`` command, in table order."""
    return tuple(f for f in FORMATS if f.verb and f.method != Method.TRT)


def for_spec(spec: Any) -> Format:
    """The row that makes ``spec``: its method, and the layout its ``format`` field asks for."""
    layout = getattr(spec, "format", None)
    rows = [f for f in FORMATS if f.method == spec.method]
    return next((f for f in rows if f.layout == layout), rows[0])


def folder(spec: Any) -> str:
    """The artifact folder name of an output: its ``name``, else derived from its method and main parameters."""
    return spec.name or for_spec(spec).folder(spec)


def calibrates(spec: Any) -> bool:
    """Whether making ``spec`` reads calibration data."""
    return for_spec(spec).calibrates(spec)


def kind(name: str) -> kinds.Kind:
    """An artifact kind by name (a row of :data:`quantkit.formats.kinds.KINDS`)."""
    return kinds.BY_NAME[name]

