"""Which linear (and MoE) kernels vLLM can run an artifact with on Hopper, how to force each, what its log says
it actually used, and which configuration to serve with.

Read from vLLM 0.26.0's own source (the ``vllm-0.26.0`` wheel, commit ffd46bfab; the GitHub snapshot was too large
to fetch): ``model_executor/kernels/linear/__init__.py`` (the per-platform priority lists ``_POSSIBLE_KERNELS``,
``_POSSIBLE_FP8_KERNELS``, ``_POSSIBLE_FP8_BLOCK_KERNELS``, ``_POSSIBLE_INT8_KERNELS``, ``VLLM_DISABLED_KERNELS`` and
the ``--linear-backend`` map), each kernel's ``is_supported``/``can_implement``, ``config/kernel.py``
(``--linear-backend``, ``--moe-backend``) and the fused-MoE oracles (``fused_moe/oracle/{int_wna16,fp8,int8}.py``).
Nothing here imports vLLM: the tables below are what that source says, so they must be re-read for another vLLM.

How vLLM 0.26.0 picks a kernel: each quantized layer walks its family's list in priority order and takes the first
kernel that is supported on the GPU and can implement the layer. There are two ways to steer it:

* ``VLLM_DISABLED_KERNELS=A,B`` (class names) skips those kernels and falls through to the next one. This is the
  targeted way (it touches only the named kernels) but it is soft: if the kernel we want cannot take a layer, vLLM
  silently uses a later one. So every run's log is parsed and a configuration is reported with the kernel vLLM
  says it used (:func:`honoured`), never with the one that was asked for.
* ``--linear-backend NAME`` keeps only that backend's kernels and fails loudly when none fits, but it applies to
  every quantized linear layer of the model (and has no entry for AllSpark). ``--moe-backend NAME`` is the only
  switch for fused experts.

FP4 (NVFP4 and MXFP4 from ``_POSSIBLE_NVFP4_KERNELS``/``_POSSIBLE_MXFP4_KERNELS``, ``init_nvfp4_linear_kernel``,
``init_mxfp4_linear_kernel``, the ``nvfp4/`` and ``mxfp4/`` kernel folders, ``fused_moe/oracle/nvfp4.py`` and
``compressed_tensors_moe_w4a4_mxfp4.py``): the CUTLASS and FlashInfer FP4 kernels need FP4 tensor cores (Blackwell,
compute capability 10.0+); on Hopper and Ampere vLLM takes Marlin, which keeps the weights in FP4 and runs the
activations in 16 bits, so a W4A4 checkpoint runs weight-only there (:mod:`quantkit.engines.numerics` says so).
Weight-only NVFP4 is always Marlin unless ``--linear-backend`` names another kernel; vLLM's emulation kernel
(``--linear-backend emulation``: FP4 activations quantized and dequantized around a 16-bit matmul) is the one way
to run NVFP4 W4A4 numerics on Hopper; MXFP4 has no emulation kernel on CUDA, and on Blackwell with FlashInfer even
an MXFP4 weight-only checkpoint gets its activations quantized (CompressedTensorsW4A4Mxfp4 ignores the config's).

The candidates are for Hopper (compute capability 9.0: H100, H200). Kernels that need an optional package
(FlashInfer, conch-triton-kernels, humming) are candidates only when that package is importable in vLLM's
environment (``packages``). Shape constraints (Machete's and Marlin's tile sizes) are not modelled: the log says.

Everything here is data in, data out (frozen dataclasses with ``to_json``), for the manifest and the model card;
:mod:`quantkit.engines.vllm.kernel_sweep` runs the measurements.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantkit.architectures import EXPERT_COUNT_KEYS
from quantkit.checkpoint import MXFP4, NVFP4, fp4_layout, quantization_config
from quantkit.engines import registry
from quantkit.formats.names import VLLM

VLLM_VERSION = registry.get(VLLM).tested  # the vLLM whose kernels, flags and log lines this module knows
DISABLED_ENV = "VLLM_DISABLED_KERNELS"
FORCE_FP8_MARLIN_ENV = "VLLM_TEST_FORCE_FP8_MARLIN"
OPTIONAL_PACKAGES = ("flashinfer", "conch", "humming", "fbgemm_gpu")  # import names vLLM 0.26.0 checks with find_spec
MOE = "moe"  # the "layer" of an expectation on fused experts
FP4_FAMILY = {NVFP4: "nvfp4", MXFP4: "mxfp4"}  # a Scheme's family for each FP4 layout
MARLIN_FP4 = {NVFP4: "MarlinNvFp4LinearKernel", MXFP4: "MarlinMxFp4LinearKernel"}  # weight-only: no FP4 arithmetic
EMULATION_FP4 = "EmulationNvFp4LinearKernel"  # FP4 activations quantized and dequantized, a bf16 matmul
EMULATION_BACKEND = "emulation"  # --linear-backend / --moe-backend value of vLLM's NVFP4 emulation
# The FP4 kernels that need FP4 tensor cores (is_supported: cutlass_fp4_supported or compute capability 10.0+).
BLACKWELL_FP4 = frozenset({"FlashInferCuteDslNvFp4LinearKernel", "FlashInferCutlassNvFp4LinearKernel",
                           "CutlassNvFp4LinearKernel", "FlashInferMxFp4LinearKernel", "FLASHINFER_CUTEDSL",
                           "FLASHINFER_CUTLASS", "VLLM_CUTLASS", "CutlassExpertsMxfp4"})

# ------------------------------------------------------------------------------------------------------------------
# What the artifact is


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme of an artifact's layers, in the terms vLLM's kernel selection uses.

    ``family``: ``wna16`` (integer weights, 16-bit activations), ``fp8`` (FP8 weights and activations, tensor or
    channel scales), ``fp8-block`` (128x128 weight blocks, per-token-group activations), ``int8`` (W8A8 INT8),
    ``nvfp4`` or ``mxfp4`` (FP4 weights in groups of 16 or 32; ``activation_scales`` None: weight-only), or
    ``other`` (a scheme vLLM serves without a choice we can steer, or that it does not log).
    ``layer``: the name vLLM's log prints after "for" when it picks the layer's kernel."""

    family: str
    layer: str
    bits: int | None = None
    symmetric: bool = True
    group_size: int | None = None  # -1: one group per output channel
    act_order: bool = False  # GPTQ g_idx (activation reordering at run time)
    weight_scales: str | None = None  # tensor | channel | block
    activation_scales: str | None = None  # tensor | token | group
    allows_cutlass_moe: bool = False  # the method lets the FP8 MoE oracle use vLLM's CUTLASS experts
    note: str = ""


@dataclass(frozen=True)
class Quantization:
    """What vLLM will load: its quantization method, the schemes of the layers, the compute dtype, MoE or not."""

    method: str  # the ``quantization`` vLLM reports: compressed-tensors, auto_awq, auto_gptq, modelopt, fp8, none
    schemes: tuple[Scheme, ...]
    dtype: str = "bfloat16"
    moe: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_MODELOPT_FP8 = {
    "FP8": ("fp8", "ModelOptFp8LinearMethod", "tensor", "tensor"),
    "FP8_PER_CHANNEL_PER_TOKEN": ("fp8", "ModelOptFp8PcPtLinearMethod", "channel", "token"),
    "FP8_PB_WO": ("fp8-block", "ModelOptFp8PbWoLinearMethod", "block", "group"),
}


# Every quant_algo vLLM 0.26.0 has a ModelOpt config class for (model_executor/layers/quantization/modelopt.py:
# ModelOptFp8Config, ModelOptNvFp4Config, ModelOptMxFp8Config); anything else, such as ModelOpt's INT4_AWQ,
# W4A8_AWQ or W8A8_SQ_PER_CHANNEL, is a TensorRT-LLM format that vLLM refuses to load.
VLLM_MODELOPT_ALGOS = (*_MODELOPT_FP8, "NVFP4", "W4A16_NVFP4", "MXFP8")


def _modelopt_algo(artifact: Path) -> str | None:
    """The quant_algo of ModelOpt's ``hf_quant_config.json``, when the folder has one."""
    hf_quant = artifact / "hf_quant_config.json"
    if not hf_quant.is_file():
        return None
    return (json.loads(hf_quant.read_text()).get("quantization") or {}).get("quant_algo")


def vllm_loads_modelopt(algo: str | None) -> bool:
    """Whether vLLM has a method for a ModelOpt export of ``algo`` (None: not a quantized export): the one rule, asked
    of a folder's hf_quant_config.json (:func:`vllm_refusal`) and of a build-trt output before it is made (the plan)."""
    return algo is None or str(algo).upper() in VLLM_MODELOPT_ALGOS


def vllm_refusal(artifact: Path) -> str | None:
    """Why vLLM cannot load ``artifact`` at all (None when it can): a ModelOpt export whose quant_algo vLLM has no
    method for. Checked before vLLM starts, so eval, smoke and tune say so instead of a server dying mid-load."""
    try:
        algo = _modelopt_algo(artifact)
    except (OSError, json.JSONDecodeError, AttributeError):
        return None  # vLLM reports an unreadable file itself
    if vllm_loads_modelopt(algo):
        return None
    return (f"{artifact} is a ModelOpt {algo} export, which vLLM {VLLM_VERSION} does not load (it serves ModelOpt "
            f"{', '.join(VLLM_MODELOPT_ALGOS)}); TensorRT-LLM serves it")


def read_quantization(artifact: Path) -> Quantization:
    """The quantization of a checkpoint folder, from ``config.json`` (and ModelOpt's ``hf_quant_config.json``)."""
    artifact = Path(artifact)
    try:
        cfg = json.loads((artifact / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{artifact}: no readable config.json ({e})") from None
    text = cfg.get("text_config") or cfg
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
                or "bfloat16")
    moe = any(int(text.get(k) or 0) > 1 for k in EXPERT_COUNT_KEYS)
    q = quantization_config(cfg)
    if (artifact / "hf_quant_config.json").exists() or q.get("quant_method") == "modelopt":
        algo = _modelopt_algo(artifact) or q.get("quant_algo")
        return Quantization("modelopt", (_modelopt_scheme(str(algo)),), dtype, moe)
    method = q.get("quant_method")
    if not q:
        return Quantization("none", (), dtype, moe)
    if method == "compressed-tensors":
        schemes = tuple(dict.fromkeys(_ct_scheme(g, q.get("format")) for g in (q.get("config_groups") or {}).values()))
        return Quantization("compressed-tensors", schemes, dtype, moe)
    if method == "awq":
        bits = int(q.get("bits") or q.get("w_bit") or 4)
        zero = bool(q.get("zero_point", True))
        return Quantization("auto_awq", (Scheme("wna16", "AutoAWQMarlinLinearMethod", bits, not zero,
                                                int(q.get("group_size") or q.get("q_group_size") or -1)),), dtype, moe)
    if method == "gptq":
        return Quantization("auto_gptq", (Scheme("wna16", "AutoGPTQLinearMethod", int(q.get("bits") or 4),
                                                 bool(q.get("sym", True)), int(q.get("group_size") or -1),
                                                 bool(q.get("desc_act"))),), dtype, moe)
    if method == "fp8":
        block = q.get("weight_block_size")
        dynamic = q.get("activation_scheme") == "dynamic"
        scheme = (Scheme("fp8-block", "Fp8LinearMethod", 8, weight_scales="block", activation_scales="group")
                  if block else Scheme("fp8", "Fp8LinearMethod", 8, weight_scales="tensor",
                                       activation_scales="token" if dynamic else "tensor"))
        return Quantization("fp8", (scheme,), dtype, moe)
    return Quantization(str(method), (Scheme("other", str(method), note=f"quant_method {method!r} is not "
                                             "covered by this table"),), dtype, moe)


def _modelopt_scheme(algo: str) -> Scheme:
    if algo in _MODELOPT_FP8:
        family, layer, w, a = _MODELOPT_FP8[algo]
        return Scheme(family, layer, 8, weight_scales=w, activation_scales=a)
    return Scheme("other", f"modelopt {algo}", note=f"vLLM {VLLM_VERSION} serves ModelOpt FP8 variants and NVFP4/"
                  f"MXFP8 (no FP4 tensor cores on Hopper); {algo} is not covered here")


def _ct_scheme(group: dict[str, Any], fmt: str | None) -> Scheme:
    """A compressed-tensors config group as vLLM 0.26.0's ``_get_scheme_from_parts`` sees it (FP4 first, as there)."""
    w = group.get("weights") or {}
    a = group.get("input_activations") or {}
    fmt = group.get("format") or fmt
    bits, wtype, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    layout = fp4_layout(w)
    if layout == NVFP4:
        if a and fp4_layout(a) != NVFP4:  # CompressedTensorsW4A4Fp4 takes NVFP4 activations or none
            return Scheme("other", "CompressedTensors", 4, note="NVFP4 weights with non-NVFP4 activations: vLLM "
                          "raises \"For NVFP4 weights, input quantization must also be NVFP4 format\"")
        return Scheme(FP4_FAMILY[NVFP4], NVFP4, 4, group_size=16, weight_scales="group",
                      activation_scales="group" if a else None)
    if layout == MXFP4:  # CompressedTensorsW4A4Mxfp4, whatever the activations say (its kernel decides)
        return Scheme(FP4_FAMILY[MXFP4], MXFP4, 4, group_size=32, weight_scales="group",
                      activation_scales="group" if a else None)
    if wtype == "int" and not a and fmt == "pack-quantized" and strategy in ("group", "channel"):
        return Scheme("wna16", "CompressedTensorsWNA16", int(bits), bool(w.get("symmetric", True)),
                      int(w.get("group_size") or -1) if strategy == "group" else -1,
                      w.get("actorder") == "group")
    if wtype == "float" and bits == 8 and a.get("type") == "float":
        if strategy == "block":
            return Scheme("fp8-block", "CompressedTensorsW8A8Fp8", 8, weight_scales="block",
                          activation_scales="group", allows_cutlass_moe=True)
        return Scheme("fp8", "CompressedTensorsW8A8Fp8", 8, weight_scales=strategy,
                      activation_scales="token" if a.get("dynamic") else "tensor", allows_cutlass_moe=True)
    if wtype == "int" and bits == 8 and a.get("type") == "int" and a.get("num_bits") == 8:
        return Scheme("int8", "CompressedTensorsW8A8Int8", 8, bool(w.get("symmetric", True)), weight_scales=strategy,
                      activation_scales="token" if a.get("dynamic") else "tensor")
    return Scheme("other", "CompressedTensors", bits, note=f"weights {wtype}{bits} {strategy}, activations "
                  f"{a.get('type')}{a.get('num_bits') or ''}, format {fmt}: not covered by this table")


# ------------------------------------------------------------------------------------------------------------------
# The kernels vLLM 0.26.0 knows, per family, in its priority order on CUDA


@dataclass(frozen=True)
class Kernel:
    """One kernel of a family: its vLLM name (class name, or MoE backend name as the log prints it), the
    ``--linear-backend``/``--moe-backend`` value that selects it, and what it needs besides."""

    name: str
    backend: str | None = None
    requires: str | None = None  # an optional package vLLM checks with find_spec
    env: tuple[tuple[str, str], ...] = ()  # a switch of its own it needs to be considered at all


@dataclass(frozen=True)
class Candidate:
    """A kernel of the scheme's family and whether vLLM could run the scheme's layers with it on Hopper."""

    kernel: Kernel
    usable: bool
    reason: str = ""
    env: tuple[tuple[str, str], ...] = ()  # what forcing it needs besides disabling the kernels ahead of it
    args: tuple[tuple[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"kernel": self.kernel.name, "backend": self.kernel.backend, "usable": self.usable,
                "reason": self.reason, "env": dict(self.env), "args": dict(self.args)}


_FP8_MARLIN = Kernel("MarlinFP8ScaledMMLinearKernel", "marlin", env=((FORCE_FP8_MARLIN_ENV, "1"),))
FAMILIES: dict[str, tuple[Kernel, ...]] = {
    "wna16": (Kernel("CutlassW4A8LinearKernel", "cutlass"), Kernel("MacheteLinearKernel", "machete"),
              Kernel("AllSparkLinearKernel"), Kernel("MarlinLinearKernel", "marlin"),
              Kernel("ConchLinearKernel", "conch", requires="conch"), Kernel("ExllamaLinearKernel", "exllama"),
              Kernel("TritonW4A16LinearKernel", "triton"), Kernel("HummingLinearKernel", "humming", "humming")),
    "fp8": (_FP8_MARLIN, Kernel("FlashInferFP8ScaledMMLinearKernel", "flashinfer_cutlass", "flashinfer"),
            Kernel("CutlassFP8ScaledMMLinearKernel", "cutlass"),
            Kernel("PerTensorTorchFP8ScaledMMLinearKernel", "torch"),
            Kernel("ChannelWiseTorchFP8ScaledMMLinearKernel", "torch"),
            Kernel("HummingFP8ScaledMMLinearKernel", "humming", "humming")),
    "fp8-block": (Kernel("FlashInferFp8DeepGEMMDynamicBlockScaledKernel", "flashinfer_cutlass", "flashinfer"),
                  Kernel("DeepGemmFp8BlockScaledMMKernel", "deep_gemm"),
                  Kernel("CutlassFp8BlockScaledMMKernel", "cutlass"), _FP8_MARLIN,
                  Kernel("TritonFp8BlockScaledMMKernel", "triton"),
                  Kernel("HummingFP8ScaledMMLinearKernel", "humming", "humming")),
    "int8": (Kernel("CutlassInt8ScaledMMLinearKernel", "cutlass"), Kernel("TritonInt8ScaledMMLinearKernel", "triton"),
             Kernel("HummingInt8ScaledMMLinearKernel", "humming", "humming")),
    # FP4 (init_nvfp4_linear_kernel, init_mxfp4_linear_kernel; the log says "Using X for NVFP4 GEMM"): Blackwell's
    # FP4 tensor cores first, then Marlin, which runs the weights in FP4 and the activations in 16 bits
    "nvfp4": (Kernel("FlashInferCuteDslNvFp4LinearKernel", "flashinfer_cutedsl", "flashinfer"),
              Kernel("FlashInferCutlassNvFp4LinearKernel", "flashinfer_cutlass", "flashinfer"),
              Kernel("CutlassNvFp4LinearKernel", "cutlass"), Kernel(MARLIN_FP4[NVFP4], "marlin"),
              Kernel("FlashInferTrtllmNvFp4LinearKernel", "flashinfer_trtllm", "flashinfer"),
              Kernel("FlashInferCudnnNvFp4LinearKernel", "flashinfer_cudnn", "flashinfer"),
              Kernel("FbgemmNvFp4LinearKernel", "fbgemm", "fbgemm_gpu"),
              Kernel(EMULATION_FP4, EMULATION_BACKEND), Kernel("HummingNvFp4LinearKernel", "humming", "humming")),
    "mxfp4": (Kernel("FlashInferMxFp4LinearKernel", "flashinfer_cutlass", "flashinfer"),
              Kernel(MARLIN_FP4[MXFP4], "marlin"), Kernel("HummingMxFp4LinearKernel", "humming", "humming")),
    # fused experts: names as the MoE oracles log them, backends as --moe-backend takes them
    "moe-wna16": (Kernel("FLASHINFER_TRTLLM", "flashinfer_trtllm", "flashinfer"), Kernel("MARLIN", "marlin"),
                  Kernel("HUMMING", "humming", "humming")),
    "moe-fp8": (Kernel("FLASHINFER_TRTLLM", "flashinfer_trtllm", "flashinfer"),
                Kernel("FLASHINFER_CUTLASS", "flashinfer_cutlass", "flashinfer"), Kernel("DEEPGEMM", "deep_gemm"),
                Kernel("VLLM_CUTLASS", "cutlass"), Kernel("TRITON", "triton"), Kernel("MARLIN", "marlin"),
                Kernel("HUMMING", "humming", "humming")),
    "moe-int8": (Kernel("TRITON", "triton"), Kernel("HUMMING", "humming", "humming")),
    # fused_moe/oracle/nvfp4.py select_nvfp4_moe_backend's order
    "moe-nvfp4": (Kernel("FLASHINFER_TRTLLM", "flashinfer_trtllm", "flashinfer"),
                  Kernel("FLASHINFER_CUTEDSL", "flashinfer_cutedsl", "flashinfer"),
                  Kernel("FLASHINFER_CUTLASS", "flashinfer_cutlass", "flashinfer"), Kernel("VLLM_CUTLASS", "cutlass"),
                  Kernel("MARLIN", "marlin"), Kernel("HUMMING", "humming", "humming"),
                  Kernel("EMULATION", EMULATION_BACKEND)),
    # CompressedTensorsW4A4Mxfp4MoEMethod picks its experts itself ("Using MarlinExperts for MXFP4 MoE"): no
    # --moe-backend reaches it
    "moe-mxfp4": (Kernel("CutlassExpertsMxfp4"), Kernel("MarlinExperts")),
}
_MOE_FAMILY = {"wna16": "moe-wna16", "fp8": "moe-fp8", "fp8-block": "moe-fp8", "int8": "moe-int8",
               "nvfp4": "moe-nvfp4", "mxfp4": "moe-mxfp4"}


def _why_not(kernel: Kernel, s: Scheme, dtype: str) -> str:
    """Why ``kernel`` cannot run the scheme's layers on Hopper ("" when it can), after vLLM 0.26.0's checks."""
    n, bits, g = kernel.name, s.bits, s.group_size
    if s.family in FP4_FAMILY.values():
        return _why_not_fp4(n, s)
    if n == "CutlassW4A8LinearKernel":
        return "needs FP8 activations (W4A8)"
    if n == "MacheteLinearKernel":
        return "" if bits in (4, 8) and g in (-1, 64, 128) else f"takes 4/8-bit weights in groups of -1/64/128 " \
                                                                f"(got {bits}-bit, group {g})"
    if n == "AllSparkLinearKernel":
        return "Ampere only (compute capability 8.x)"
    if n == "MarlinLinearKernel":
        if not s.symmetric and bits != 4:
            return "zero points only with 4-bit weights"
        return "" if bits in (4, 8) and g in (-1, 32, 64, 128) else f"takes groups of -1/32/64/128 (got {g})"
    if n == "ConchLinearKernel":
        return "" if g in (-1, 128) and not s.act_order else "takes groups of -1/128 and no act-order"
    if n == "ExllamaLinearKernel":
        return "" if s.symmetric and bits in (4, 8) and (g or 0) > 0 else "symmetric grouped weights only"
    if n == "TritonW4A16LinearKernel":
        return "" if bits == 4 and g in (-1, 32, 64, 128, 256) and not s.act_order else \
            "4-bit weights in groups of -1/32/64/128/256, no act-order"
    if n == "HummingLinearKernel":
        return "no act-order" if s.act_order else ""
    if n == "FlashInferFP8ScaledMMLinearKernel":
        return "Blackwell only (compute capability 10.0+)"
    if n == "PerTensorTorchFP8ScaledMMLinearKernel":
        return "" if (s.weight_scales, s.activation_scales) == ("tensor", "tensor") else \
            "needs per-tensor weight and activation scales"
    if n == "ChannelWiseTorchFP8ScaledMMLinearKernel":
        return "" if (s.weight_scales, s.activation_scales) != ("tensor", "tensor") else \
            "not for per-tensor weight and activation scales"
    if n == "DeepGemmFp8BlockScaledMMKernel" and dtype != "bfloat16":
        return "bfloat16 output only"
    if n == "VLLM_CUTLASS":
        if s.weight_scales == "block":
            return "no block-scaled weights"
        return "" if s.allows_cutlass_moe else f"{s.layer} does not allow vLLM's CUTLASS experts"
    if n == "DEEPGEMM":
        return "" if s.weight_scales == "block" and dtype == "bfloat16" else "128x128 block-scaled weights only"
    if n == "FLASHINFER_TRTLLM" and s.family == "wna16":
        return "MXINT4 experts only"
    return ""


def _why_not_fp4(name: str, s: Scheme) -> str:
    """Why an FP4 kernel cannot run the scheme's layers on Hopper ("" when it can)."""
    if name in BLACKWELL_FP4:
        return "Blackwell only (FP4 tensor cores: compute capability 10.0+)"
    weight_only = s.activation_scales is None
    if s.family == FP4_FAMILY[NVFP4] and weight_only and name != MARLIN_FP4[NVFP4] and name != "MARLIN":
        return "weight-only NVFP4 always runs on Marlin (init_nvfp4_linear_kernel forces it for W4A16)"
    if name in (EMULATION_FP4, "EMULATION") and weight_only:
        return "emulates FP4 activations, which a weight-only checkpoint has no scale for"
    return ""


def _kernel_args(kernel: Kernel, dtype: str) -> tuple[tuple[str, Any], ...]:
    """Engine arguments forcing ``kernel`` needs: Exllama runs only with float16 activations."""
    if kernel.name == "ExllamaLinearKernel" and dtype != "float16":
        return (("dtype", "float16"),)
    return ()


def assess(scheme: Scheme, dtype: str = "bfloat16", packages: frozenset[str] | set[str] = frozenset(),
           moe: bool = False) -> list[Candidate]:
    """Every kernel of the scheme's family (its fused-experts family with ``moe``), in vLLM's priority order,
    with whether it can run the scheme on Hopper and why not."""
    family = _MOE_FAMILY.get(scheme.family) if moe else scheme.family
    out = []
    for k in FAMILIES.get(family or "", ()):
        reason = f"needs the optional package {k.requires!r} in vLLM's environment" \
            if k.requires and k.requires not in packages else _why_not(k, scheme, dtype)
        out.append(Candidate(k, not reason, reason, k.env, _kernel_args(k, dtype)))
    return out


def candidates(scheme: Scheme, dtype: str = "bfloat16", packages: frozenset[str] | set[str] = frozenset(),
               moe: bool = False) -> list[Candidate]:
    """The usable kernels, in vLLM's priority order."""
    return [c for c in assess(scheme, dtype, packages, moe) if c.usable]


def default_kernel(scheme: Scheme, dtype: str = "bfloat16", packages: frozenset[str] | set[str] = frozenset(),
                   moe: bool = False) -> str | None:
    """The kernel vLLM picks with no flags: the first usable one that needs no switch of its own."""
    return next((c.kernel.name for c in candidates(scheme, dtype, packages, moe) if not c.env and not c.args), None)


# ------------------------------------------------------------------------------------------------------------------
# Configurations: one vLLM start each


@dataclass(frozen=True)
class Configuration:
    """One way to start vLLM: environment and engine arguments, and the kernels its log must then name.

    ``expect`` holds (layer, kernel) pairs: the layer as the log prints it (``CompressedTensorsWNA16``) or
    ``moe``, the kernel class name or MoE backend name. ``kind`` is default, linear, moe or combined."""

    name: str
    kind: str
    expect: tuple[tuple[str, str], ...]
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)
    forced_by: str = ""  # how, in words: "VLLM_DISABLED_KERNELS", "--linear-backend", "--moe-backend", ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "expect": [list(e) for e in self.expect], "env": self.env,
                "args": self.args, "forced_by": self.forced_by}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Configuration:
        return cls(data["name"], data["kind"], tuple(tuple(e) for e in data["expect"]), dict(data.get("env") or {}),
                   dict(data.get("args") or {}), data.get("forced_by", ""))


def configurations(q: Quantization, packages: frozenset[str] | set[str] = frozenset(),
                   force: str = "env") -> list[Configuration]:
    """The default configuration, then one per other usable linear kernel of each scheme (``force``: ``env``
    disables the kernels ahead of it with VLLM_DISABLED_KERNELS, ``backend`` uses --linear-backend where the
    kernel has one), then one per other usable MoE backend (--moe-backend)."""
    if force not in ("env", "backend"):
        raise ValueError(f"force must be 'env' or 'backend', not {force!r}")
    default_expect = []
    for s in q.schemes:
        if k := default_kernel(s, q.dtype, packages):
            default_expect.append((s.layer, k))
        if q.moe and (m := default_kernel(s, q.dtype, packages, moe=True)):
            default_expect.append((MOE, m))
    out = [Configuration("default", "default", tuple(dict.fromkeys(default_expect)))]
    for s in q.schemes:
        usable = candidates(s, q.dtype, packages)
        default = default_kernel(s, q.dtype, packages)
        for i, c in enumerate(usable):
            if c.kernel.name == default:
                continue
            ahead = [a.kernel.name for a in usable[:i] if not a.env and not a.args]
            env, args = dict(c.env), dict(c.args)
            if force == "backend" and c.kernel.backend:
                args["linear_backend"] = c.kernel.backend
                how = "--linear-backend"
            elif ahead:
                env[DISABLED_ENV] = ",".join(ahead)
                how = DISABLED_ENV
            else:  # first in vLLM's list once its own switch is on (FP8 Marlin's test variable)
                how = ", ".join([*env, *("--" + a.replace("_", "-") for a in args)])
            out.append(Configuration(c.kernel.name, "linear", ((s.layer, c.kernel.name),), env, args, how))
    if q.moe:
        seen = set()
        for s in q.schemes:
            default = default_kernel(s, q.dtype, packages, moe=True)
            for c in candidates(s, q.dtype, packages, moe=True):
                if c.kernel.name == default or c.kernel.name in seen or not c.kernel.backend:
                    continue
                seen.add(c.kernel.name)
                out.append(Configuration(f"moe:{c.kernel.name}", "moe", ((MOE, c.kernel.name),), dict(c.env),
                                         {**dict(c.args), "moe_backend": c.kernel.backend}, "--moe-backend"))
    return out


def combine(linear: Configuration, moe: Configuration) -> Configuration:
    """One configuration forcing both a linear kernel and a MoE backend."""
    env = {**linear.env, **moe.env}
    disabled = [k for c in (linear, moe) for k in c.env.get(DISABLED_ENV, "").split(",") if k]
    if disabled:
        env[DISABLED_ENV] = ",".join(dict.fromkeys(disabled))
    return Configuration(f"{linear.name} + {moe.name}", "combined", linear.expect + moe.expect, env,
                         {**linear.args, **moe.args}, " and ".join(x for x in (linear.forced_by, moe.forced_by) if x))


# ------------------------------------------------------------------------------------------------------------------
# What the log says


@dataclass(frozen=True)
class LogFacts:
    """What a vLLM log says it did: quantization method, linear kernels per layer, MoE backends, the error."""

    quantization: str | None = None
    linear: tuple[tuple[str, str], ...] = ()  # (layer, kernel) in order of appearance
    moe: tuple[str, ...] = ()
    error: str | None = None

    def kernels(self) -> list[str]:
        """Human lines: "MacheteLinearKernel for CompressedTensorsWNA16", "MARLIN (MoE)"."""
        return [f"{k} for {layer}" for layer, k in self.linear] + [f"{m} (MoE)" for m in self.moe]

    def to_json(self) -> dict[str, Any]:
        return {"quantization": self.quantization, "linear": [list(x) for x in self.linear], "moe": list(self.moe),
                "kernels": self.kernels(), "error": self.error}


# "Using MacheteLinearKernel for CompressedTensorsWNA16", "Selected CutlassFP8ScaledMMLinearKernel for
# ModelOptFp8LinearMethod", "Using FlashInferCutlassMxfp8LinearKernel for MXFP8 GEMM"
_LINEAR = re.compile(r"\b(?:Using|Selected) (\w+Kernel) for (\w+)")
# "Using TRITON Fp8 MoE backend out of potential backends: [...]", "Using 'MARLIN' WNA16 MoE backend."
_MOE_LINE = re.compile(r"\bUsing '?([A-Z][A-Z0-9_]*)'? [\w ]*?MoE backend")
# "Using MarlinExperts for MXFP4 MoE": compressed-tensors' MXFP4 experts, chosen without an oracle
_MXFP4_MOE_LINE = re.compile(r"\bUsing (\w+Experts\w*) for MXFP4 MoE\b")
# ModelOpt's W4A16_NVFP4 method calls Marlin FP4 itself and names no kernel class; only this warning says so
_MARLIN_FP4_WARNING = "Weight-only FP4 compression will be used leveraging the Marlin kernel"
MARLIN_FP4_DIRECT = ("FP4 (weight-only, no kernel class)", "Marlin")
_QUANT = re.compile(r"\bquantization=([\w-]+)")
_ERROR = re.compile(r"\b((?:[A-Za-z_][\w.]*)?(?:Error|Exception)): (.+)$")
_WRAPPER_ERRORS = ("Engine core initialization failed", "See root cause above", "EngineCore failed")
_CALM_RECORD = re.compile(r"\b(?:DEBUG|INFO|WARNING) \d\d-\d\d ")  # a log record that merely mentions an error


def log_facts(text: str) -> LogFacts:
    """Parse a vLLM log (offline ``LLM`` or ``vllm serve``; EngineCore prefixes and colour codes allowed)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    quant = _QUANT.search(text)
    linear = tuple(dict.fromkeys((layer, k) for k, layer in _LINEAR.findall(text)))
    if _MARLIN_FP4_WARNING in text and not any("Fp4" in k for _, k in linear):
        linear += (MARLIN_FP4_DIRECT,)
    moe = tuple(dict.fromkeys(_MOE_LINE.findall(text) + _MXFP4_MOE_LINE.findall(text)))
    errors = [f"{m.group(1)}: {m.group(2).strip()}" for line in text.splitlines()
              if not _CALM_RECORD.search(line) and (m := _ERROR.search(line))]
    root = [e for e in errors if not any(w in e for w in _WRAPPER_ERRORS)]
    error = (root or errors or [None])[-1]
    return LogFacts(quant.group(1) if quant else None, linear, moe, error[:500] if error else None)


def honoured(config: Configuration, facts: LogFacts) -> bool | None:
    """Whether vLLM used exactly the kernels the configuration expects for each expected layer (None when the
    configuration expects nothing, e.g. an unquantized model)."""
    if not config.expect:
        return None
    for layer, kernel in config.expect:
        used = set(facts.moe) if layer == MOE else {k for lyr, k in facts.linear if lyr == layer}
        if used != {kernel}:
            return False
    return True


# ------------------------------------------------------------------------------------------------------------------
# Measurements, the choice and the serve command


@dataclass
class Measurement:
    """One configuration run: what vLLM used and how fast it was. ``status``: ok, failed, timeout, not run.
    ``decode_tok_s`` maps the batch size (as a string, for JSON) to decode tokens/s."""

    configuration: Configuration
    status: str
    facts: LogFacts = field(default_factory=LogFacts)
    ttft_s: float | None = None
    decode_tok_s: dict[str, float] = field(default_factory=dict)
    seconds: float | None = None
    log: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # what the child reported besides (versions, sample, ...)

    @property
    def honoured(self) -> bool | None:
        return honoured(self.configuration, self.facts) if self.status == "ok" else None

    def to_json(self) -> dict[str, Any]:
        return {"configuration": self.configuration.to_json(), "status": self.status, "honoured": self.honoured,
                "facts": self.facts.to_json(), "ttft_s": self.ttft_s, "decode_tok_s": self.decode_tok_s,
                "seconds": self.seconds, "log": self.log, "error": self.error, "extra": self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        f = data.get("facts") or {}
        facts = LogFacts(f.get("quantization"), tuple(tuple(x) for x in f.get("linear") or ()),
                         tuple(f.get("moe") or ()), f.get("error"))
        return cls(Configuration.from_json(data["configuration"]), data["status"], facts, data.get("ttft_s"),
                   dict(data.get("decode_tok_s") or {}), data.get("seconds"), data.get("log"), data.get("error"),
                   dict(data.get("extra") or {}))


@dataclass(frozen=True)
class Choice:
    """The configuration to serve with, and why."""

    configuration: Configuration
    reason: str
    measured: bool  # False for a combination of a linear and a MoE choice that was never run together
    decode_tok_s: float | None = None
    default_tok_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"configuration": self.configuration.to_json(), "reason": self.reason, "measured": self.measured,
                "decode_tok_s": self.decode_tok_s, "default_tok_s": self.default_tok_s}


def choose(measurements: list[Measurement], batch: int = 1, min_gain: float = 0.03,
           max_loss: float = 0.05) -> Choice | None:
    """The fastest configuration by decode tokens/s at ``batch``, among runs that finished and used the kernels
    they asked for. A forced kernel must beat vLLM's default by ``min_gain`` (a forced kernel is one more thing
    to keep true across vLLM upgrades); otherwise the default stays. A forced kernel that is more than ``max_loss``
    slower than the default at any other measured batch is never chosen: on the 8B shape on an H200, Exllama
    decoded 23% faster than Machete at batch 1 and 53% slower at batch 16, and a server meets both. The reason says
    which faster configurations were passed over, and why. With a MoE model, the best linear and the best MoE
    configurations are combined (``measured`` says whether that combination itself was run)."""
    key = str(batch)
    ok = [m for m in measurements if m.status == "ok" and key in m.decode_tok_s
          and (m.configuration.kind == "default" or m.honoured)]
    default = next((m for m in ok if m.configuration.kind == "default"), None)
    if not ok:
        return None
    base = default.decode_tok_s[key] if default else None
    losses = {id(m): loss for m in ok if (loss := _worst_loss(m, default, key, max_loss))}
    eligible = [m for m in ok if id(m) not in losses]

    def best(kinds: tuple[str, ...]) -> Measurement | None:
        pool = [m for m in eligible if m.configuration.kind in kinds]
        return max(pool, key=lambda m: m.decode_tok_s[key]) if pool else None

    def worth(m: Measurement | None) -> bool:
        return m is not None and (base is None or m.decode_tok_s[key] > base * (1 + min_gain))

    def passed_over(tok: float | None) -> str:
        faster = [m for m in ok if id(m) in losses and (tok is None or m.decode_tok_s[key] > tok)]
        return "".join(f"; passed over {m.configuration.name} ({m.decode_tok_s[key]:.0f} tok/s at batch {batch}, "
                       f"but {losses[id(m)]})" for m in faster)

    combined = best(("combined",))
    linear, moe = best(("linear",)), best(("moe",))
    if worth(combined) and all(combined.decode_tok_s[key] >= x.decode_tok_s[key] for x in (linear, moe) if x):
        return _choice(combined, key, base, "fastest measured, linear kernel and MoE backend together",
                       passed_over(combined.decode_tok_s[key]))
    pick_linear, pick_moe = worth(linear), worth(moe)
    if pick_linear and pick_moe:
        assert linear is not None and moe is not None
        both = combine(linear.configuration, moe.configuration)
        return Choice(both, f"fastest linear kernel ({linear.decode_tok_s[key]:.0f} tok/s) and fastest MoE backend "
                      f"({moe.decode_tok_s[key]:.0f} tok/s) at batch {batch}, measured apart"
                      + passed_over(max(linear.decode_tok_s[key], moe.decode_tok_s[key])), False, None, base)
    if pick_linear or pick_moe:
        m = linear if pick_linear else moe
        assert m is not None
        return _choice(m, key, base, f"fastest decode at batch {batch}", passed_over(m.decode_tok_s[key]))
    if default is None:  # every eligible forced run is "worth" it without a default; all of them lose elsewhere
        return None
    return _choice(default, key, base, f"no forced kernel beats vLLM's default by more than {min_gain:.0%} at "
                   f"batch {batch}", passed_over(base))


def _worst_loss(m: Measurement, default: Measurement | None, key: str, max_loss: float) -> str | None:
    """How much slower than the default ``m`` decodes at its worst other batch, when that is over ``max_loss``."""
    if default is None or m is default:
        return None
    worst = min(((v / default.decode_tok_s[b] - 1, b) for b, v in m.decode_tok_s.items()
                 if b != key and default.decode_tok_s.get(b)), default=None)
    return f"{worst[0]:+.1%} against the default at batch {worst[1]}" if worst and worst[0] < -max_loss else None


def _choice(m: Measurement, key: str, base: float | None, why: str, passed_over: str = "") -> Choice:
    tok = m.decode_tok_s[key]
    gain = f" ({tok:.0f} tok/s, {tok / base - 1:+.1%} against the default)" if base and m.configuration.kind != \
        "default" else f" ({tok:.0f} tok/s)"
    return Choice(m.configuration, why + gain + passed_over, True, tok, base)


@dataclass(frozen=True)
class ServeCommand:
    """``vllm serve`` for a configuration: the environment it needs and the argument list."""

    env: dict[str, str]
    argv: list[str]

    def shell(self) -> str:
        """One line to paste into a shell."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), shlex.join(self.argv)])

    def to_json(self) -> dict[str, Any]:
        return {"env": self.env, "argv": self.argv, "shell": self.shell()}


def serve_command(model: str, config: Configuration, extra_args: list[str] | tuple[str, ...] = ()) -> ServeCommand:
    """The ``vllm serve`` command (and environment) that starts vLLM the way ``config`` did."""
    argv = ["vllm", "serve", model]
    for key, value in config.args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return ServeCommand(dict(config.env), argv + list(extra_args))


def markdown(measurements: list[Measurement], choice: Choice | None, batches: tuple[int, ...] = (1, 16)) -> str:
    """The sweep as a markdown table (model card, report), the chosen configuration marked."""
    head = "| configuration | forced by | kernel vLLM used | TTFT ms | " + \
        " | ".join(f"decode tok/s b{b}" for b in batches) + " | note |"
    lines = [head, "|" + "---|" * (5 + len(batches))]
    for m in measurements:
        c = m.configuration
        name = f"**{c.name}** (chosen)" if choice and choice.measured and choice.configuration == c else c.name
        forced = ", ".join([f"`{k}={v}`" for k, v in c.env.items()] + [f"`--{k.replace('_', '-')} {v}`"
                                                                       for k, v in c.args.items()]) or "-"
        used = "<br>".join(m.facts.kernels()) or "-"
        note = m.error or ""
        if m.status == "ok" and m.honoured is False:
            want = ", ".join(k for _, k in c.expect)
            note = f"asked for {want}; vLLM used what this row names"
        elif m.status != "ok":
            note = f"{m.status}: {note}".rstrip(": ")
        ttft = f"{m.ttft_s * 1000:.1f}" if m.ttft_s is not None else "-"
        tok = [f"{m.decode_tok_s[str(b)]:.0f}" if str(b) in m.decode_tok_s else "-" for b in batches]
        cells = [name, forced, used, ttft, *tok, note.replace("|", "\\|")[:200]]
        lines.append("| " + " | ".join(cells) + " |")
    if choice:
        lines += ["", f"Chosen: {choice.configuration.name}: {choice.reason}."]
    return "\n".join(lines) + "\n"
