"""Which arithmetic an FP4 W4A4 artifact is measured with, in each engine and on each GPU, said in one line.

A W4A4 FP4 checkpoint (NVFP4 or MXFP4 with FP4 activations: :func:`quantkit.checkpoint.fp4`) asks for FP4
arithmetic, which only GPUs with FP4 tensor cores have. vLLM 0.26 runs it with its CUTLASS or FlashInfer FP4 kernels
from compute capability 10.0 (Blackwell: ``cutlass_fp4_supported``; MXFP4 needs FlashInfer there too); below that it
takes its Marlin FP4 kernels, which keep the weights in FP4 and run the activations in 16 bits, and logs "Your GPU
does not have native support for FP4 computation". The checkpoint then runs weight-only: on an H200 its perplexity
equals its W4A16 twin's to the fourth digit (issue 40). transformers, on any device, runs compressed-tensors' forward
wrapper, which quantizes each Linear's input to FP4 and back (``forward_quantize``) around a 16- or 32-bit matmul:
the W4A4 numerics of a Blackwell GPU, emulated. vLLM's NVFP4 emulation kernel (``--linear-backend emulation``) does
the same on a GPU; MXFP4 has none on CUDA.

So every score and smoke run of a W4A4 artifact records which of these it measured (the labels below), and doctor,
smoke and eval say it in one line (a warning where it runs weight-only). ``quantkit eval --numerics`` chooses: ``auto``
(what the engine does by itself), ``emulated`` (FP4 activations emulated) or ``weight-only`` (activations left
unquantized, what Hopper serves).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from quantkit.checkpoint import MXFP4, Fp4, fp4, read_config
from quantkit.engines.transformers import dense_copy
from quantkit.engines.vllm import kernels
from quantkit.errors import UsageError
from quantkit.formats.names import TRANSFORMERS, VLLM

# What a measurement of a W4A4 artifact was: the recorded ``numerics``.
W4A4 = "w4a4"  # FP4 activations in FP4 arithmetic (a GPU with FP4 tensor cores)
EMULATED = "emulated w4a4"  # FP4 activations quantized and dequantized around a 16/32-bit matmul
MARLIN_WEIGHT_ONLY = "weight-only (Marlin FP4: this GPU has no FP4 arithmetic)"
WEIGHT_ONLY = "weight-only"  # activations left unquantized, as asked
DENSE_COPY = "weight-only (a dense copy: transformers cannot reload FP4 experts)"

# What ``--numerics`` asks for.
AUTO, ASK_EMULATED, ASK_WEIGHT_ONLY = "auto", "emulated", "weight-only"
CHOICES = (AUTO, ASK_EMULATED, ASK_WEIGHT_ONLY)
ENGINES = (TRANSFORMERS, VLLM)  # the engines --numerics can steer

FP4_ARITHMETIC = (10, 0)  # the compute capability from which vLLM 0.26 runs FP4 activations (CUTLASS, FlashInfer)


def w4a4(path: Path) -> Fp4 | None:
    """The FP4 quantization of a checkpoint folder when it is W4A4 (None otherwise, GGUF files included)."""
    found = fp4(read_config(path)) if Path(path).is_dir() else None
    return found if found is not None and found.w4a4 else None


def check(path: Path, asked: str, engine: str) -> None:
    """Refuse ``--numerics`` where it means nothing, before anything loads: an artifact that is not FP4 W4A4, an
    engine that cannot be steered, MXFP4 emulated in vLLM (vLLM 0.26 has no MXFP4 emulation kernel on CUDA)."""
    if asked not in CHOICES:
        raise UsageError(f"--numerics {asked!r}: choose one of {', '.join(CHOICES)}")
    if asked == AUTO:
        return
    found = w4a4(path)
    if found is None:
        raise UsageError(f"--numerics {asked}: {path} is not an FP4 W4A4 checkpoint (NVFP4 or MXFP4 with FP4 "
                         "activations), so it has no activation numerics to choose",
                         hint="leave --numerics out (auto) for this artifact")
    if engine not in ENGINES:
        raise UsageError(f"--numerics {asked}: the {engine} engine cannot be told how to run FP4 activations",
                         hint=f"evaluate it with --engine {' or '.join(ENGINES)}")
    if engine == TRANSFORMERS and asked == ASK_EMULATED and dense_copy.needed(path):
        raise UsageError(f"--numerics emulated: transformers reads {path}'s FP4 experts only through a dense copy, "
                         "which runs weight-only", hint="score the emulated numerics with --engine vllm (NVFP4)")
    if engine == VLLM and asked == ASK_EMULATED and found.layout == MXFP4:
        raise UsageError(f"--numerics emulated: vLLM {kernels.VLLM_VERSION} has no MXFP4 emulation kernel on CUDA "
                         "(only NVFP4's, --linear-backend emulation)",
                         hint="score the emulated MXFP4 W4A4 numerics with --engine transformers")


def vllm_args(asked: str, moe: bool) -> dict[str, str]:
    """vLLM engine arguments that make it run a W4A4 artifact as ``asked``: NVFP4's emulation kernel, or Marlin FP4
    (on Blackwell too); nothing for ``auto``."""
    backend = {ASK_EMULATED: kernels.EMULATION_BACKEND, ASK_WEIGHT_ONLY: "marlin"}.get(asked)
    if backend is None:
        return {}
    return {"linear_backend": backend, **({"moe_backend": backend} if moe else {})}


def of_vllm_kernels(used: Iterable[str], asked: str = AUTO) -> str | None:
    """What vLLM ran a W4A4 artifact with, from the linear kernels its log names (None: no FP4 kernel named)."""
    names = set(used)
    if names & set(kernels.MARLIN_FP4.values()):
        return WEIGHT_ONLY if asked == ASK_WEIGHT_ONLY else MARLIN_WEIGHT_ONLY
    if kernels.EMULATION_FP4 in names:
        return EMULATED
    if names & kernels.BLACKWELL_FP4:
        return W4A4
    return None


def of_gpu(found: Fp4, capability: tuple[int, int], flashinfer: bool) -> str:
    """What vLLM will run a W4A4 artifact with on a GPU of this compute capability (before it starts)."""
    if tuple(capability) < FP4_ARITHMETIC or (found.layout == MXFP4 and not flashinfer):
        return MARLIN_WEIGHT_ONLY
    return W4A4


def line(found: Fp4, numerics: str, where: str) -> str:
    """The one line said about a measurement of a W4A4 artifact, ``where`` naming the engine and device."""
    what = f"this {found.layout} W4A4 artifact"
    if numerics == MARLIN_WEIGHT_ONLY:
        return (f"{where} runs {what} weight-only (Marlin FP4: this GPU has no FP4 arithmetic): its scores are its "
                f"W4A16 twin's, not what a Blackwell GPU's FP4 activations give (quantkit eval --numerics emulated "
                f"measures those)")
    if numerics == DENSE_COPY:
        return (f"{where} runs {what} weight-only: transformers 5.17 cannot reload FP4 experts, so it scores a dense "
                "copy decompressed by compressed-tensors (quantkit eval --engine vllm --numerics emulated runs "
                "NVFP4's FP4 activations)")
    if numerics == WEIGHT_ONLY:
        return f"{where} runs {what} weight-only, as asked: its activations unquantized, as Hopper and Ampere serve it"
    if numerics == EMULATED:
        return (f"{where} runs {what} with its activations quantized to FP4 and back around a 16/32-bit matmul: "
                "emulated w4a4, the numerics a Blackwell GPU runs")
    return f"{where} runs {what} in FP4 arithmetic (w4a4)"
