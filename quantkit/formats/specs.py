"""The recipe's method specs: one pydantic class per method, the fields a recipe (or a verb's flags) can set.

A spec is data, like an llm-compressor modifier's arguments: it says *what* to make, never how. The registry
(:mod:`quantkit.formats`) pairs each spec with its producer, its artifact kind and its CLI verb; the recipe
(:mod:`quantkit.recipe`) is built from the registry's specs. Validation happens before any model loads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from quantkit.formats import gguf_types
from quantkit.formats.names import Method

# The error type of a validator's refusal that names the value it was given: a recipe error shows no "got ..." after it
NAMES_ITS_INPUT = "names_its_input"
GROUP_SIZES = (-1, 32, 64, 128, 256)
# An unset group_size is 128, or where 128 does not divide every layer's input width (SmolLM2's hidden_size is 576),
# the largest of these that does: the group sizes vLLM 0.26's int4/int8 weight-only kernels take (Machete, Hopper's
# first choice: -1, 64, 128; Marlin: -1, 32, 64, 128; see quantkit.engines.vllm.kernels). -1 when none divides.
DEFAULT_GROUP_SIZE = 128
FALLBACK_GROUP_SIZES = (64, 32)
# `gptq --target-bits B` with neither a group size nor a symmetry given, B at least TARGET_BITS_GROUP_FROM: int4 in
# groups of 32 with zero points (quantkit.producers.compressed.group_choice). On SmolLM2-135M it scored an exact KLD
# of 0.0293 at 5.53 bits against 0.0370 at group 64 symmetric (bench/results/h200/bits_g32a/); at 5.0 bits the two
# were level (0.047 and 0.049), so below 5.5 the plain default stays.
TARGET_BITS_GROUP_SIZE = 32
TARGET_BITS_GROUP_FROM = 5.5
NVFP4_GROUP_SIZE = 16  # fixed by each FP4 format (compressed-tensors' NVFP4 and MXFP4 presets, OCP MX)
MXFP4_GROUP_SIZE = 32
W4A8_GROUP_SIZE = 128  # the only size llm-compressor's W4AFP8 scheme and vLLM's CUTLASS W4A8 kernel take
TARGET_BITS_HELP = ("average bits per weight of the quantized layers (packed values, scales and zero points), "
                    "reached by keeping the layers whose 4-bit quantization costs the most KLD (each measured on the "
                    "calibration set) at 8 bits; unset: every layer at `bits`")
GROUP_HELP = ("weights per quantization group: 32, 64, 128, 256, or -1 for one group per output channel; unset: 128, "
              "or the largest of 64 and 32 that divides every layer's input width (the manifest records which)")


class Strict(BaseModel):
    """Unknown keys are errors: a typo in a recipe must never be silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_group_size(v: int | None) -> int | None:
    if v is not None and v not in GROUP_SIZES:
        raise ValueError(f"must be one of {', '.join(map(str, GROUP_SIZES))} (-1 = one group per output channel)")
    return v


def _check_target_bits(spec: "AwqSpec | GptqSpec | RtnSpec") -> None:
    """A bits target mixes int4 and int8 layers in one compressed-tensors checkpoint: it starts from 4 bits, and the
    legacy AutoAWQ/GPTQ layouts carry one bit width for the whole model."""
    if spec.target_bits is None:
        return
    if spec.bits != 4:
        raise ValueError("target_bits mixes int4 and int8 layers starting from int4: leave bits at 4")
    if getattr(spec, "format", "compressed-tensors") != "compressed-tensors":
        raise ValueError(f"target_bits makes a mixed-precision compressed-tensors checkpoint; the {spec.format} layout "
                         "carries one bit width for every layer")


class MethodBase(Strict):
    """Fields every quantization method shares."""

    name: str | None = Field(None, description="artifact folder name inside a multi-output release")
    ignore: list[str] = Field(default_factory=list, description="modules kept in full precision besides the "
                              "defaults: names or re: patterns, each must match a module (see quantkit.ignore)")
    default_ignore: bool = Field(True, description="also keep lm_head and mixture-of-experts router gates in full "
                                 "precision")


class AwqSpec(MethodBase):
    """AWQ W4A16 through llm-compressor's AWQModifier (activation-aware scaling, then group quantization)."""

    method: Literal[Method.AWQ.value]
    bits: Literal[4, 8] = 4
    group_size: int | None = Field(None, description=GROUP_HELP)
    symmetric: bool = False
    format: Literal["compressed-tensors", "autoawq"] = "compressed-tensors"
    duo_scaling: bool = True
    offload_activations: bool = Field(False, description="keep AWQ's cached layer inputs in pinned host memory "
                                      "between the grid search's passes instead of on the GPU (llm-compressor's "
                                      "offload_device='cpu'): the same scales, less GPU memory, much more time "
                                      "(8B shape, 32 x 2048 tokens, H200: 13.5 instead of 16.0 GiB, 305 instead "
                                      "of 183 s)")
    target_bits: float | None = Field(None, gt=0, le=16, description=TARGET_BITS_HELP)
    _g = field_validator("group_size")(_check_group_size)

    @model_validator(mode="after")
    def _target(self) -> "AwqSpec":
        _check_target_bits(self)
        return self


class GptqSpec(MethodBase):
    """GPTQ W4A16/W8A16 through llm-compressor's GPTQModifier (second-order error compensation)."""

    method: Literal[Method.GPTQ.value]
    bits: Literal[4, 8] = 4
    group_size: int | None = Field(None, description=GROUP_HELP)
    symmetric: bool = True
    act_order: bool = Field(True, description="GPTQ activation ordering (static: no g_idx, no runtime cost)")
    damp: float = Field(0.01, gt=0, lt=1, description="dampening as a fraction of the Hessian diagonal mean")
    imatrix: bool = Field(True, description="choose each group's range with llm-compressor's importance-weighted "
                          "MSE observer (imatrix_mse: quantization error weighted by each input channel's mean "
                          "squared activation on the calibration set) instead of the group's min and max; on by "
                          "default since it lowered KLD on both measured models (SmolLM2-135M 0.160 -> 0.097, the "
                          "reference model 0.0430 -> 0.0379) for about 6% more time")
    awq: bool = Field(False, description="smooth with AWQ first (llm-compressor's AWQModifier with duo scaling, "
                      "its mappings for the architecture), then quantize with GPTQ inside the smoothed weights: "
                      "llm-compressor's AWQ-then-GPTQ recipe; one more calibration pass")
    format: Literal["compressed-tensors", "gptq"] = "compressed-tensors"
    target_bits: float | None = Field(None, gt=0, le=16, description=TARGET_BITS_HELP)
    _g = field_validator("group_size")(_check_group_size)

    @model_validator(mode="after")
    def _target(self) -> "GptqSpec":
        _check_target_bits(self)
        return self


class AutoRoundSpec(MethodBase):
    """AutoRound W4A16/W8A16 through llm-compressor's AutoRoundModifier: each decoder layer's rounding offsets and
    weight clipping tuned by signed gradient descent against the layer's full-precision output.

    Symmetric only: llmcompressor 0.14.0.1's modifier carries AutoRound's scales back into the checkpoint but not
    its zero points, so an asymmetric artifact would be written with the wrong ones."""

    method: Literal[Method.AUTOROUND.value]
    bits: Literal[4, 8] = 4
    group_size: int | None = Field(None, description=GROUP_HELP)
    symmetric: Literal[True] = Field(True, description="symmetric only (see above)")
    iterations: int = Field(200, ge=1, le=10_000, description="tuning steps per decoder layer (AutoRound's and "
                            "llm-compressor's default 200; each step runs one batch of calibration samples)")
    batch_size: int = Field(8, ge=1, le=1024, description="calibration samples per tuning step")
    lr: float | None = Field(None, gt=0, lt=1, description="signed-gradient step size; unset: 1 / iterations, "
                             "AutoRound's own default")
    _g = field_validator("group_size")(_check_group_size)


class Fp8Spec(MethodBase):
    """FP8 E4M3 weights with their scales: static (calibrated input scales), dynamic, or 128x128 blocks."""

    method: Literal[Method.FP8.value]
    scheme: Literal["static", "dynamic", "block"] = "static"
    kv_cache_fp8: bool = False


class Int8Spec(MethodBase):
    """SmoothQuant then W8A8 INT8 (per-channel weights, dynamic per-token activations)."""

    method: Literal[Method.INT8.value]
    smoothing_strength: float = Field(0.8, gt=0.0, lt=1.0)
    weights: Literal["gptq", "rtn"] = "gptq"


class W4a8Spec(MethodBase):
    """W4A8 for Hopper: int4 weights (group 128, symmetric) with FP8 E4M3 activations quantized per token at run
    time (llm-compressor's W4AFP8 scheme; vLLM serves it with its CUTLASS W4A8 kernel on Hopper)."""

    method: Literal[Method.W4A8.value]
    weights: Literal["gptq", "rtn"] = "gptq"
    group_size: Literal[128] = Field(W4A8_GROUP_SIZE,
                                     description="the one group size the scheme and vLLM's kernel take")


class RtnSpec(MethodBase):
    """Round-to-nearest W4A16/W8A16: no calibration, the baseline AWQ and GPTQ must beat."""

    method: Literal[Method.RTN.value]
    bits: Literal[4, 8] = 4
    group_size: int | None = Field(None, description=GROUP_HELP)
    symmetric: bool = True
    target_bits: float | None = Field(None, gt=0, le=16, description=TARGET_BITS_HELP)
    _g = field_validator("group_size")(_check_group_size)

    @model_validator(mode="after")
    def _target(self) -> "RtnSpec":
        _check_target_bits(self)
        return self


FP4_SCHEME_HELP = ("w4a16: FP4 weights, activations left in bf16/fp16 (llm-compressor's NVFP4A16 / MXFP4A16 presets); "
                   "w4a4: FP4 activations too (its NVFP4 / MXFP4 presets). w4a16 by default: on Hopper and Ampere "
                   "vLLM 0.26 runs a W4A4 checkpoint weight-only anyway (Marlin FP4, the same perplexity to the fourth "
                   "digit on an H200), and NVFP4's W4A4 needs calibration data for its activations' global scales")
# The FP4 weight observer an unset ``observer`` means, per algorithm, as measured on SmolLM2-135M-Instruct (CPU, exact
# KLD, bench/results/fp4_cpu/): GPTQ's column updates do better inside MSE-chosen ranges (NVFP4 0.071 against 0.081
# with min-max), round-to-nearest does worse with them (NVFP4 0.257 against 0.218, MXFP4 0.374 against 0.347, and ten
# times slower on a CPU), and so does AWQ's (NVFP4 0.106 against 0.097, MXFP4 0.247 against 0.242), whose own grid
# search scores with min-max.
FP4_OBSERVERS = {"gptq": "mse", "rtn": "minmax", "awq": "minmax"}
FP4_OBSERVER_HELP = (", ".join(f"{o} with {a}" for a, o in FP4_OBSERVERS.items())
                     + ", the lower KLD measured (bench/results/fp4_cpu/)")
# The 8-bit layers an FP4 bits target may mix in, per FP4 method and scheme: the mixes vLLM 0.26 loaded on an H200
# (bench/results/h200/fp4/mixes.md: NVFP4A16 and MXFP4A16 with FP8_DYNAMIC and with W8A16, NVFP4 W4A4 with
# FP8_DYNAMIC). A mix it was not measured loading (NVFP4 W4A4 with int8, MXFP4 W4A4 with either) is refused before any
# work. The first of each is the default: int8 weight-only scored lower than FP8-dynamic on SmolLM2-135M-Instruct at
# each target measured, for the same bits (NVFP4 round-to-nearest, exact KLD on 2,048 tokens: 0.113/0.123 at 5.0,
# 0.079/0.092 at 5.5, 0.055/0.071 at 6.0; bench/results/fp4_bits_cpu/), and NVFP4 W4A4 has FP8 only.
FP4_MIXES: dict[tuple[str, str], tuple[str, ...]] = {
    (Method.NVFP4, "w4a16"): (Method.INT8, Method.FP8), (Method.NVFP4, "w4a4"): (Method.FP8,),
    (Method.MXFP4, "w4a16"): (Method.INT8, Method.FP8)}
FP4_TARGET_BITS_HELP = ("average bits per weight of the quantized layers, scales included (NVFP4 alone is 4.5, MXFP4 "
                        "4.25): the layer groups whose FP4 quantization costs the most KLD (each measured on the "
                        "calibration set) go to 8 bits (--high) until the average is reached; unset: every layer FP4")
FP4_HIGH_HELP = ("the 8-bit layers of a --target-bits mix: int8 (int8 weight-only, one bf16 scale per output channel, "
                 "8.03 bits per weight at width 576) or fp8 (llm-compressor's FP8_DYNAMIC: FP8 E4M3 weights per "
                 "channel and FP8 activations per token); unset: int8, which scored the lower KLD on "
                 "SmolLM2-135M-Instruct at every target measured (0.079 against 0.092 at 5.5 bits, "
                 "bench/results/fp4_bits_cpu/), and fp8 for nvfp4 --scheme w4a4, the one W4A4 mix vLLM 0.26 was "
                 "measured loading (bench/results/h200/fp4/mixes.md)")


class Fp4Spec(MethodBase):
    """FP4 (E2M1) weights through llm-compressor's NVFP4/MXFP4 presets, weight-only or with FP4 activations, by
    round-to-nearest, GPTQ or AWQ-then-round-to-nearest. One class for both formats: they differ only in the group
    and scale format (:class:`Nvfp4Spec`, :class:`Mxfp4Spec`), which the preset fixes."""

    scheme: Literal["w4a16", "w4a4"] = Field("w4a16", description=FP4_SCHEME_HELP)
    algorithm: Literal["rtn", "gptq", "awq"] = Field(
        "gptq", description="how the FP4 weights are chosen: rtn (round-to-nearest, no calibration for weight-only), "
                            "gptq (llm-compressor's GPTQModifier with the FP4 scheme, static act-order), awq "
                            "(AWQModifier's smoothing, then round-to-nearest); gptq by default: on SmolLM2-135M-Instruct "
                            "(CPU, 16 x 512 calibration tokens, exact KLD on 4,096 held-out tokens) NVFP4 W4A16 scored "
                            "0.071 by GPTQ, 0.097 by AWQ and 0.218 by round-to-nearest (bench/results/fp4_cpu/)")
    observer: Literal["minmax", "mse"] | None = Field(
        None, description="llm-compressor's observer for the weights' FP4 scales: minmax (memoryless_minmax, each "
                          "group's absolute maximum) or mse (memoryless_mse, the range that minimises the group's "
                          "quantization error); unset: " + FP4_OBSERVER_HELP)
    target_bits: float | None = Field(None, gt=0, le=16, description=FP4_TARGET_BITS_HELP)
    high: Literal[Method.INT8.value, Method.FP8.value] | None = Field(None, description=FP4_HIGH_HELP)

    @model_validator(mode="after")
    def _mix(self) -> "Fp4Spec":
        """Refuse, before any work, a mix vLLM was not measured loading (:data:`FP4_MIXES`), and --high alone."""
        if self.target_bits is None:
            if self.high is not None:
                raise ValueError("high chooses the 8-bit layers of a target_bits mix: give target_bits, or drop high")
            return self
        loaded = FP4_MIXES.get((self.method, self.scheme), ())
        if not loaded or (self.high is not None and self.high not in loaded):
            what = f"{self.method} {self.scheme} layers mixed with {self.high or 'any 8-bit'} layers"
            ok = "; ".join(f"{m} {s} with {' or '.join(h)}" for (m, s), h in FP4_MIXES.items())
            raise ValueError(f"target_bits: vLLM 0.26 was not measured loading {what} (bench/results/h200/fp4/"
                             f"mixes.md); the mixes it loads: {ok}")
        return self

    @property
    def high_precision(self) -> str:
        """The 8-bit layers' precision of a bits target: the one asked for, else the mix's measured default."""
        return self.high or FP4_MIXES[self.method, self.scheme][0]

    @property
    def weight_observer(self) -> str:
        """The observer this spec runs: the one asked for, else the algorithm's measured default."""
        return self.observer or FP4_OBSERVERS[self.algorithm]

    @property
    def bits(self) -> int:
        """FP4 values are 4 bits, like the int4 methods' (what the size estimate reads); the group scales add 0.5
        bits per weight for NVFP4 (8 per 16) and 0.25 for MXFP4 (8 per 32)."""
        return 4

    @property
    def calibrates(self) -> bool:
        """Whether making this spec reads calibration data: GPTQ and AWQ always; round-to-nearest for a bits target
        (each layer group's sensitivity is measured on it) and for NVFP4's W4A4, whose static activation global
        scales are observed on data (MXFP4's activation scales are dynamic, and weight scales need no data)."""
        return (self.algorithm != "rtn" or self.target_bits is not None
                or (self.scheme == "w4a4" and self.method == Method.NVFP4))


class Nvfp4Spec(Fp4Spec):
    """NVFP4: FP4 E2M1 values in groups of 16, each group with an FP8 E4M3 scale under one FP32 global scale per
    tensor (Blackwell's native format; vLLM serves it with Marlin FP4 on Hopper and Ampere)."""

    method: Literal[Method.NVFP4.value]
    group_size: Literal[16] = Field(NVFP4_GROUP_SIZE, description="the one group size NVFP4 has")


class Mxfp4Spec(Fp4Spec):
    """MXFP4 (OCP microscaling): FP4 E2M1 values in groups of 32, each group with a power-of-two E8M0 scale."""

    method: Literal[Method.MXFP4.value]
    group_size: Literal[32] = Field(MXFP4_GROUP_SIZE, description="the one group size MXFP4 has")


class GgufSpec(MethodBase):
    """GGUF for llama.cpp: convert once, then quantize into each type with llama.cpp's own quantizer."""

    method: Literal[Method.GGUF.value]
    types: list[str] = Field(default_factory=lambda: ["Q4_K_M"], min_length=1)
    imatrix: bool = Field(False, description="compute llama.cpp's importance matrix from the calibration set")
    imatrix_file: str | None = Field(None, description="an importance matrix made elsewhere (llama-imatrix .gguf "
                                     "or legacy .dat)")
    target_bits: float | None = Field(None, gt=0, le=16, description="average bits per weight of the transformer "
                                      "blocks' matrices: the type's own mix, with the layer groups whose quantization "
                                      "costs the most KLD (measured on the calibration set) raised to Q8_0")

    @field_validator("types")
    @classmethod
    def _types(cls, v: list[str]) -> list[str]:
        try:
            return gguf_types.validate(v)
        except ValueError as e:  # it names the bad types itself
            raise PydanticCustomError(NAMES_ITS_INPUT, "{why}", {"why": str(e)}) from None

    @model_validator(mode="after")
    def _one_matrix(self) -> "GgufSpec":
        if self.imatrix and self.imatrix_file:
            raise ValueError("imatrix (compute one from the calibration set) and imatrix_file were both given; "
                             "choose one")
        return self


class TrtLimits(Strict):
    """TensorRT-LLM engine limits passed to trtllm-build."""

    max_batch_size: int = Field(8, ge=1)
    max_input_len: int = Field(1024, ge=1)
    max_seq_len: int = Field(2048, ge=1)
    max_num_tokens: int = Field(8192, ge=1)
    paged_kv_cache: bool = True
    gemm_plugin: str | None = "auto"


class TrtSpec(MethodBase):
    """ModelOpt quantization + export for TensorRT-LLM (unified HF checkpoint and TRT-LLM checkpoint)."""

    method: Literal[Method.TRT.value]
    quantization: Literal["fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4", "w4a16_nvfp4", "none"] = "fp8"
    kv_cache: Literal["fp8", "int8", "auto"] = "auto"
    tp: int = Field(1, ge=1, le=64)
    pp: int = Field(1, ge=1, le=64)
    limits: TrtLimits = Field(default_factory=TrtLimits)
    checkpoint_only: bool = False
