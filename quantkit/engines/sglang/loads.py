"""What SGLang 0.5.17 loads, as data read from its wheel's source, and the refusals made before its server starts.

Read from ``sglang-0.5.17-cp312-cp312-manylinux_2_34_x86_64.whl`` (paths under ``sglang/srt/``), for CUDA on Hopper
(sm90), the GPU this engine is written for:

- ``layers/quantization/__init__.py``: ``BASE_QUANTIZATION_METHODS`` plus ``mxfp4`` on CUDA -> :data:`QUANT_METHODS`,
  the ``quant_method`` values SGLang has a config class for;
- ``layers/quantization/compressed_tensors/compressed_tensors.py``: ``_quantization_scheme_map_from_config`` (a config
  group's own ``format`` wins over the top-level one; ``input_activations`` are read only under an activation
  format), ``_get_scheme_from_parts`` (every dense layer: :data:`LINEAR`), ``get_moe_scheme`` (fused experts:
  :data:`MOE`), and ``from_config``, which passes no ``kv_cache_scheme`` on;
- ``layers/quantization/compressed_tensors/utils.py``: ``is_activation_quantization_format``
  -> :data:`ACTIVATION_FORMATS` (``nvfp4-pack-quantized`` is one, ``mxfp4-pack-quantized`` is not);
- FP4 (read from the ``sglang-0.5.17-cp311`` wheel, the same source): ``_is_fp4a4_nvfp4`` takes NVFP4 only with FP4
  activations, for ``CompressedTensorsW4A4Fp4`` (``get_min_capability`` 100: Blackwell) in dense layers and
  ``CompressedTensorsW4A4Nvfp4MoE`` (which refuses below Blackwell) in experts; weight-only NVFP4 reaches no scheme;
  MXFP4's group-32 float weights fall into the WNA16 branch of dense layers, which serves ``pack-quantized`` only,
  while its experts go to ``Mxfp4MoEMethod`` (``_is_mxfp4_moe``). On Hopper no FP4 artifact quantkit writes loads;
- ``.../schemes/compressed_tensors_wNa16.py``: ``WNA16_SUPPORTED_TYPES_MAP`` (4 and 8 bits, with or without zero
  points) and its Marlin-only path (``apply_gptq_marlin_linear``; ``check_marlin_supports_shape`` is called and its
  answer ignored), which GPTQ's ``gptq_marlin`` takes too;
- ``sglang/kernels/jit/csrc/gemm/marlin/gptq_marlin.cuh`` (the kernel that path compiles): the thread tiles of
  ``small_batch_thread_configs`` and ``large_batch_thread_configs`` -> :data:`MARLIN_TILES`; a layer whose (input,
  output) features no tile divides stops at its first forward ("Invalid thread config");
- ``layers/quantization/awq/awq.py`` (``AWQConfig``: 4 bits only) and ``gptq/gptq.py`` (``GPTQConfig``: 2, 3, 4, 8);
- ``configs/model_config.py``: ``_parse_quant_hf_config`` and ``_parse_modelopt_quant_config`` (:data:`MODELOPT`): a
  ModelOpt export whose config.json says quant_method "modelopt" (as ModelOpt 0.47's do) with another quant_algo stays
  "modelopt", whose class ``ModelOptFp8Config`` refuses it (``layers/quantization/modelopt_quant.py``); one with only
  hf_quant_config.json gets no quantization config at all, and would load as if it were unquantized.

Checked on a CPU against SGLang 0.5.17's own ``CompressedTensorsConfig`` (CUDA answered as an H200 would): for every
compressed-tensors preset quantkit writes, and the variants above, its ``_get_scheme_from_parts`` and
``get_moe_scheme`` chose the scheme (or raised the error) these rules give; the one rule beyond what construction
shows is dense block FP8 with static activations, refused later by ``process_weights_after_loading``.

The rules are tried in SGLang's order; the first that matches decides, as in its ``if`` chains. A rule without a
scheme is a branch where SGLang raises: its message is quoted. Nothing here imports SGLang, so the table must be
read again for another version (:data:`VERSION`; doctor warns when the installed one differs).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.architectures import EXPERT_COUNT_KEYS
from quantkit.checkpoint import quantization_config, read_config

VERSION = "0.5.17"
SOURCE = f"sglang {VERSION}: sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py"

QUANT_METHODS = frozenset({
    "fp8", "mxfp8", "blockwise_int8", "modelopt", "modelopt_fp8", "modelopt_fp4", "nvfp4_online", "modelopt_mixed",
    "w8a8_int8", "w8a8_fp8", "awq", "awq_marlin", "bitsandbytes", "gguf", "gptq", "gptq_marlin", "moe_wna16",
    "compressed-tensors", "w4afp8", "petit_nvfp4", "quark", "quark_mxfp4", "auto-round", "auto-round-int8", "modelslim",
    "quark_int4fp8_moe", "humming", "mxfp_w4a8", "mxfp4"})

ACTIVATION_FORMATS = ("naive-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized", "pack-quantized")

# ModelOpt's quant_algo -> SGLang's method (model_config._parse_modelopt_quant_config): FP8 or FP4 anywhere in the
# name, or MIXED_PRECISION; of what quantkit's build-trt writes only FP8 is one of them.
MODELOPT = (("MIXED_PRECISION", "w4afp8"), ("FP4", "modelopt_fp4"), ("FP8", "modelopt_fp8"))

MARLIN_TILES = ((128, 128), (64, 128), (128, 64), (64, 256))  # (thread_k, thread_n): input, output features


@dataclass(frozen=True)
class Args:
    """Conditions on one ``QuantizationArgs`` (weights or input activations); a field left None takes any value."""

    type: str | None = None  # int | float
    bits: tuple[int, ...] | None = None
    strategies: tuple[str, ...] | None = None
    symmetric: bool | None = None
    dynamic: bool | None = None

    def matches(self, a: Mapping[str, Any]) -> bool:
        return ((self.type is None or a.get("type", "int") == self.type)
                and (self.bits is None or a.get("num_bits", 8) in self.bits)
                and (self.strategies is None or _strategy(a) in self.strategies)
                and (self.symmetric is None or bool(a.get("symmetric", True)) == self.symmetric)
                and (self.dynamic is None or bool(a.get("dynamic", False)) == self.dynamic))


@dataclass(frozen=True)
class Rule:
    """One branch of SGLang's scheme choice for a config group.

    ``inputs``: None matches a group that quantizes no activations, ``ANY_INPUTS`` any group, an :class:`Args` a
    group whose activations match it. ``formats``: the group's effective format (its own, else the top-level one);
    None: any. ``scheme``: SGLang's scheme class; None: SGLang raises ``error`` there."""

    weights: Args
    inputs: Args | str | None
    formats: tuple[str, ...] | None
    scheme: str | None
    error: str = ""

    def matches(self, weights: Mapping[str, Any], inputs: Mapping[str, Any] | None, fmt: str | None) -> bool:
        if self.formats is not None and fmt not in self.formats:
            return False
        if not self.weights.matches(weights):
            return False
        if self.inputs == ANY_INPUTS:
            return True
        if self.inputs is None or inputs is None:
            return self.inputs is None and inputs is None
        assert isinstance(self.inputs, Args)
        return self.inputs.matches(inputs)


ANY_INPUTS = "any"
_WNA16 = Args(strategies=("channel", "group"), dynamic=False)
_FP8_W = Args(type="float", symmetric=True, dynamic=False, strategies=("tensor", "channel", "block"))
_INT8_W = Args(bits=(8,), symmetric=True, dynamic=False, strategies=("tensor", "channel"))
_NVFP4 = Args(type="float", bits=(4,), strategies=("tensor_group",), symmetric=True)
_MXFP4 = Args(type="float", bits=(4,), strategies=("group",), symmetric=True)  # group 32 (the presets' only size)
_FP8_STATIC = Args(type="float", dynamic=False, symmetric=True, strategies=("tensor",))
_NO_SCHEME = "No compressed-tensors compatible scheme was found."

# _get_scheme_from_parts, in its order (the first two branches are outside the activation-format test).
LINEAR: tuple[Rule, ...] = (
    Rule(Args(strategies=_WNA16.strategies, dynamic=False, bits=(4, 8), symmetric=True), None, ("pack-quantized",),
         "CompressedTensorsWNA16"),
    Rule(Args(strategies=_WNA16.strategies, dynamic=False, bits=(4, 8), symmetric=False), None, ("pack-quantized",),
         "CompressedTensorsWNA16"),
    # MXFP4 (format mxfp4-pack-quantized, not an activation format: its input_activations are never read) takes the
    # WNA16 branch, whose only non-pack-quantized answer is this error, W4A16 and W4A4 alike
    Rule(_MXFP4, None, None, None, "Other method (CompressedTensorsW4A16Sparse24) is not supported now (its WNA16 "
         "branch takes MXFP4's float groups and serves pack-quantized integers only: no dense MXFP4 scheme)"),
    Rule(_WNA16, None, None, None, "Other method (CompressedTensorsW4A16Sparse24) is not supported now"),
    Rule(_NVFP4, Args(type="float", bits=(4,), strategies=("tensor_group",), symmetric=True), ACTIVATION_FORMATS,
         None, "Current platform does not support w4a4 nvfp4 quantization. (NVFP4 needs a Blackwell GPU)"),
    # weight-only NVFP4: _is_fp4a4_nvfp4 needs FP4 activations too, and no later branch takes float4 weights
    Rule(_NVFP4, None, ACTIVATION_FORMATS, None, "No compressed-tensors compatible scheme was found. (SGLang has "
         "NVFP4 only with FP4 activations, W4A4, on Blackwell)"),
    Rule(_FP8_W, Args(type="float", dynamic=True), ACTIVATION_FORMATS, "CompressedTensorsW8A8Fp8"),
    Rule(Args(type="float", symmetric=True, dynamic=False, strategies=("block",)), _FP8_STATIC, ACTIVATION_FORMATS,
         None, "AssertionError: CompressedTensorsW8A8Fp8 takes block weights with dynamic activations only "
         "(process_weights_after_loading)"),
    Rule(_FP8_W, _FP8_STATIC, ACTIVATION_FORMATS, "CompressedTensorsW8A8Fp8"),
    Rule(Args(type="float", symmetric=True, dynamic=False, strategies=("tensor", "channel")), ANY_INPUTS,
         ACTIVATION_FORMATS, "CompressedTensorsW8A16Fp8"),
    Rule(_INT8_W, Args(bits=(8,), strategies=("tensor",), dynamic=False), ACTIVATION_FORMATS,
         "CompressedTensorsW8A8Int8"),
    Rule(_INT8_W, Args(bits=(8,), strategies=("token",), dynamic=True), ACTIVATION_FORMATS,
         "CompressedTensorsW8A8Int8"),
    Rule(Args(), ANY_INPUTS, None, None, _NO_SCHEME),
)

# get_moe_scheme on CUDA (not NPU or ROCm), in its order; its W4A8 test reads the top-level format. MXFP4 experts are
# taken before it (get_quant_method's _is_mxfp4_moe: "Using Mxfp4MoEMethod for MXFP4 compressed-tensors MoE").
MOE: tuple[Rule, ...] = (
    Rule(_MXFP4, ANY_INPUTS, None, "Mxfp4MoEMethod"),
    Rule(Args(strategies=_WNA16.strategies, dynamic=False, bits=(4, 8), symmetric=True), None, ("pack-quantized",),
         "CompressedTensorsWNA16MoE"),
    Rule(Args(strategies=_WNA16.strategies, dynamic=False, bits=(4, 8), symmetric=False), None, ("pack-quantized",),
         "CompressedTensorsWNA16MoE"),
    Rule(_WNA16, None, None, None, "For Fused MoE layers, only pack-quantized is supported for the following bits: "
         "[4, 8]"),
    Rule(_NVFP4, Args(type="float", bits=(4,), strategies=("tensor_group",), symmetric=True), None, None,
         "Current platform does not support NVFP4 quantization. Please use Blackwell and above."),
    # _is_fp8_w8a8, then the constructor: tensor weights with tensor activations, channel weights with dynamic
    # per-token activations, or block weights; any other pairing trips its assertion. (Dense block weights with static
    # activations pass construction and trip process_weights_after_loading's assertion: the LINEAR rule above.)
    Rule(Args(type="float", symmetric=True, dynamic=False, strategies=("tensor",)),
         Args(type="float", strategies=("tensor",)), None, "CompressedTensorsW8A8Fp8MoE"),
    Rule(Args(type="float", symmetric=True, dynamic=False, strategies=("channel",)),
         Args(type="float", strategies=("token",), dynamic=True), None, "CompressedTensorsW8A8Fp8MoE"),
    Rule(Args(type="float", symmetric=True, dynamic=False, strategies=("block",)), Args(type="float"), None,
         "CompressedTensorsW8A8Fp8MoE"),
    Rule(_FP8_W, Args(type="float"), None, None, "AssertionError in CompressedTensorsW8A8Fp8MoE: it takes tensor "
         "weights with tensor activations, channel weights with dynamic per-token activations, or block weights"),
    Rule(Args(bits=(8,), symmetric=True, dynamic=False, strategies=("tensor", "channel")),
         Args(bits=(8,), strategies=("token",), dynamic=True), None, None,
         "The W8A8Int8 Fused MoE scheme is implemented only for NPU for now."),
    Rule(Args(type="int", bits=(4,), symmetric=True, dynamic=False), Args(bits=(8,), dynamic=True),
         ("pack-quantized",), "CompressedTensorsW4AFP8MoE"),
    Rule(Args(), ANY_INPUTS, None, None, "Unsupported FusedMoe scheme"),
)


@dataclass(frozen=True)
class Finding:
    """One thing the table says about an artifact: ``ok``, ``warn`` (it loads, with a caveat) or ``fail``."""

    name: str
    status: str
    message: str
    hint: str | None = None


def _strategy(a: Mapping[str, Any]) -> str:
    """compressed-tensors' default when a config leaves the strategy out: group with a group size, else tensor."""
    s = a.get("strategy")
    return str(s) if s else ("group" if a.get("group_size") else "tensor")


def describe(weights: Mapping[str, Any], inputs: Mapping[str, Any] | None, fmt: str | None) -> str:
    """A config group in a few words, for messages."""
    w = f"{weights.get('type', 'int')}{weights.get('num_bits', 8)} {_strategy(weights)} weights" + \
        ("" if weights.get("symmetric", True) else " with zero points")
    a = "no activation quantization" if inputs is None else \
        f"{inputs.get('type', 'int')}{inputs.get('num_bits', 8)} {_strategy(inputs)} " \
        f"{'dynamic' if inputs.get('dynamic') else 'static'} activations"
    return f"{w}, {a}, format {fmt}"


def choose(rules: tuple[Rule, ...], weights: Mapping[str, Any], inputs: Mapping[str, Any] | None,
           fmt: str | None, top: str | None = None) -> Rule:
    """The rule SGLang takes for one config group whose effective format is ``fmt`` (the last rule of each table
    matches anything). The MoE table tests the top-level format ``top`` (CompressedTensorsWNA16MoE and the W4A8 test
    read ``quant_config.quant_format``), the dense one the group's."""
    if fmt not in ACTIVATION_FORMATS:
        inputs = None  # _quantization_scheme_map_from_config reads input_activations only under an activation format
    tested = (top if top is not None else fmt) if rules is MOE else fmt
    return next(r for r in rules if r.matches(weights, inputs, tested))


def _is_moe(cfg: Mapping[str, Any]) -> bool:
    text = cfg.get("text_config") or cfg
    return any(int(text.get(k) or 0) > 1 for k in EXPERT_COUNT_KEYS)


def marlin_misfits(cfg: Mapping[str, Any], tp: int = 1) -> list[str]:
    """The linear layers of a Llama-like decoder, as SGLang fuses them (qkv_proj, gate_up_proj) and splits them over
    ``tp`` GPUs, whose (input, output) features no Marlin tile divides, as ``name in->out``."""
    text = cfg.get("text_config") or cfg
    try:
        hidden, inter = int(text["hidden_size"]), int(text.get("intermediate_size") or 0)
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or hidden // heads)
        kv = int(text.get("num_key_value_heads") or heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return []
    layers = {"qkv_proj": (hidden, (heads + 2 * kv) * head_dim // tp), "o_proj": (heads * head_dim // tp, hidden)}
    if inter:
        layers |= {"gate_up_proj": (hidden, 2 * inter // tp), "down_proj": (inter // tp, hidden)}
    return [f"{name} {k}->{n}" for name, (k, n) in layers.items()
            if not any(k % tk == 0 and n % tn == 0 for tk, tn in MARLIN_TILES)]


def _marlin_finding(cfg: Mapping[str, Any]) -> Finding | None:
    bad = marlin_misfits(cfg)
    if not bad:
        return None
    return Finding("sglang marlin", "fail",
                   f"SGLang {VERSION} runs W4A16 and W8A16 layers in its Marlin kernel only, and no Marlin tile "
                   f"(input x output features {', '.join(f'{k}x{n}' for k, n in MARLIN_TILES)}; "
                   "sglang/kernels/jit/csrc/gemm/marlin/gptq_marlin.cuh) divides these: "
                   f"{', '.join(bad)}: its first forward stops with \"Invalid thread config\"",
                   "serve it with vLLM, whose other W4A16 kernels take these shapes, or serve FP8 or INT8 in SGLang")


def _ct_findings(q: Mapping[str, Any], cfg: Mapping[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    moe = _is_moe(cfg)
    top = q.get("format")
    wna16 = False
    if not q.get("config_groups"):
        out.append(Finding("sglang scheme", "warn", "no config_groups: SGLang quantizes no layer of it"))
    for name, group in (q.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        inputs = group.get("input_activations") or None
        fmt = group.get("format") or top
        what = describe(weights, inputs, fmt)
        for layers, rules in (("dense layers", LINEAR), *((("experts", MOE),) if moe else ())):
            rule = choose(rules, weights, inputs, fmt, top)
            if rule.scheme is None:
                out.append(Finding("sglang scheme", "fail", f"SGLang {VERSION} has no scheme for {name} ({what}) "
                                   f"in its {layers}: it raises \"{rule.error}\" ({SOURCE})",
                                   "serve it with vLLM, or quantize a scheme SGLang loads (W4A16/W8A16, FP8, "
                                   "INT8 W8A8 on dense models)"))
            else:
                out.append(Finding("sglang scheme", "ok", f"{name} ({what}): {rule.scheme} in the {layers}"))
                wna16 |= rule.scheme == "CompressedTensorsWNA16"
    if wna16 and (marlin := _marlin_finding(cfg)):
        out.append(marlin)
    if q.get("kv_cache_scheme"):
        out.append(Finding("sglang kv cache", "warn",
                           f"SGLang {VERSION} does not read compressed-tensors' kv_cache_scheme (from_config passes "
                           "none on): the KV cache stays in the model's dtype unless --kv-cache-dtype fp8_e4m3 is "
                           "passed (--server-arg)"))
    return out


def _modelopt_method(algo: str | None) -> str | None:
    name = str(algo or "").upper()
    return next((method for key, method in MODELOPT if key in name), None)


def _modelopt_findings(q: Mapping[str, Any], hf_quant: Path) -> list[Finding]:
    """A ModelOpt export: its quantization_config (ModelOpt 0.47 writes quant_method "modelopt" into config.json), else
    its hf_quant_config.json, as SGLang's _parse_quant_hf_config reads them."""
    algo = q.get("quant_algo")
    if algo is None and hf_quant.is_file():
        try:
            algo = (json.loads(hf_quant.read_text()).get("quantization") or {}).get("quant_algo")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            return [Finding("sglang modelopt", "fail", f"{hf_quant} is unreadable: {e}")]
    method = _modelopt_method(algo)
    if method is not None:
        return [Finding("sglang modelopt", "ok", f"ModelOpt {algo} -> SGLang's {method}")]
    hint = "serve it with TensorRT-LLM (--engine trtllm)"
    if q:  # kept as "modelopt", whose config class is ModelOptFp8Config
        return [Finding("sglang modelopt", "fail", f"SGLang {VERSION} reads ModelOpt's quant_method 'modelopt' with "
                        f"its FP8 config, which refuses quant_algo {algo}: \"ModelOptFp8Config only supports static "
                        "FP8 quantization in SGLang.\" (layers/quantization/modelopt_quant.py)", hint)]
    return [Finding("sglang modelopt", "fail", f"SGLang {VERSION} does not recognise ModelOpt quant_algo {algo} "
                    "(configs/model_config.py _parse_modelopt_quant_config knows FP8, FP4 and MIXED_PRECISION): it "
                    "would load the checkpoint as if it were unquantized", hint)]


def findings(path: Path) -> list[Finding]:
    """What SGLang makes of an artifact folder (or file), before any server starts."""
    path = Path(path)
    if path.is_file() or not (path / "config.json").exists() and list(path.glob("*.gguf")):
        return [Finding("sglang format", "fail", "quantkit serves and scores GGUF files with llama.cpp (SGLang's GGUF "
                        "loader is not what quantkit tests)", "use --engine llama.cpp")]
    cfg = read_config(path)
    q = quantization_config(cfg)
    hf_quant = path / "hf_quant_config.json"
    # _parse_quant_hf_config: a quantization_config without quant_method, or with "modelopt", is ModelOpt's; without
    # any, hf_quant_config.json is read.
    if (q and q.get("quant_method", "modelopt") == "modelopt") or (not q and hf_quant.is_file()):
        return _modelopt_findings(q, hf_quant)
    if not cfg:
        return [Finding("sglang format", "fail", f"{path} has no readable config.json: SGLang serves Hugging Face "
                        "checkpoints")]
    method = q.get("quant_method")
    if not q:
        return [Finding("sglang format", "ok", "an unquantized checkpoint")]
    if method not in QUANT_METHODS:
        return [Finding("sglang method", "fail", f"SGLang {VERSION} has no quantization method {method!r} "
                        "(layers/quantization/__init__.py BASE_QUANTIZATION_METHODS)")]
    if method == "compressed-tensors":
        return _ct_findings(q, cfg)
    bits = q.get("bits") or q.get("w_bit")
    if method == "awq" and bits not in (None, 4):
        return [Finding("sglang method", "fail", f"SGLang {VERSION}'s AWQ reads 4-bit checkpoints only "
                        f"(awq/awq.py AWQConfig), this one is {bits}-bit")]
    if method == "gptq" and bits not in (None, 2, 3, 4, 8):
        return [Finding("sglang method", "fail", f"SGLang {VERSION}'s GPTQ reads 2, 3, 4 and 8-bit checkpoints "
                        f"(gptq/gptq.py GPTQConfig), this one is {bits}-bit")]
    out = [Finding("sglang method", "ok", f"quant_method {method}")]
    # gptq_marlin (GPTQMarlinConfig.override_quantization_method: 4 or 8 bits, symmetric) runs the same Marlin kernel,
    # without a per-layer fallback; AutoAWQ's awq_marlin falls back to AWQ's own kernels layer by layer.
    if method == "gptq" and bits in (None, 4, 8) and q.get("sym", True) and (marlin := _marlin_finding(cfg)):
        out.append(marlin)
    return out


def refusal(path: Path) -> str | None:
    """Why SGLang cannot load ``path`` (None when the table says it can): the first failing finding."""
    return next((f.message for f in findings(path) if f.status == "fail"), None)


# ------------------------------------------------------------------------------------------------------------------
# The engine's own environment


# A transformers that defines this model type already breaks SGLang's import: sglang/srt/configs/qwen3_asr.py calls
# AutoConfig.register("qwen3_asr", ...) at import, which raises ValueError in transformers newer than the 5.12.1 it
# pins (seen with 5.17.0, the H200 image's). Doctor asks the engine's Python whether this module exists.
CONFLICTING_MODULE = "transformers.models.qwen3_asr"


def env_findings(requires: list[str], versions: Mapping[str, str], modules: Mapping[str, bool],
                 installed: str | None) -> list[Finding]:
    """SGLang's exact pins against what its Python has, the transformers clash, and the table's version."""
    from packaging.requirements import InvalidRequirement, Requirement

    out: list[Finding] = []
    if installed and installed.split("+")[0] != VERSION:
        out.append(Finding("sglang version", "warn", f"SGLang {installed} is installed; quantkit's load table was "
                           f"read from {VERSION}'s source"))
    differ = []
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        pins = [s.version for s in req.specifier if s.operator == "=="]
        have = versions.get(req.name)
        if pins and have is not None and not req.specifier.contains(have, prereleases=True):
            differ.append(f"{req.name} {have} (pins {pins[0]})")
    if differ:
        out.append(Finding("sglang pins", "warn", f"SGLang pins other versions of: {', '.join(differ)}"))
    elif requires:
        out.append(Finding("sglang pins", "ok", "every exact pin SGLang declares that is installed matches"))
    if modules.get(CONFLICTING_MODULE):
        out.append(Finding("sglang transformers", "fail",
                           f"this transformers ({versions.get('transformers', '?')}) defines qwen3_asr, which SGLang "
                           f"{VERSION} registers itself at import (sglang/srt/configs/qwen3_asr.py): its server dies "
                           "with \"ValueError: 'qwen3_asr' is already used by a Transformers config\"",
                           "install the transformers SGLang pins (5.12.1) ahead of the other on its PYTHONPATH"))
    return out
