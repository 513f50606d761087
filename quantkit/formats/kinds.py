"""Artifact kinds: what a folder (or file) on disk is, which engine evaluates it and which serves it.

One row per kind, tried in order; the first whose test matches wins. ``inspect``, ``doctor``, ``eval``
(``--engine auto``) and ``smoke`` (``--engine auto``) all ask :func:`detect`, so they never disagree about what
a folder is. Tests read only file names and ``config.json``-style files, never weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantkit.checkpoint import gguf_files, quant_method, read_config
from quantkit.errors import UsageError
from quantkit.formats.names import LLAMACPP, TRANSFORMERS, TRTLLM, VLLM, KindName


@dataclass(frozen=True)
class Kind:
    """One kind of artifact on disk.

    ``evaluate`` is the engine ``quantkit eval`` uses for it (None: it cannot be scored as it is), ``serve`` the
    engine ``quantkit smoke`` starts (None: nothing serves it as it is).
    """

    name: str
    label: str
    evaluate: str | None
    serve: str | None
    test: Callable[[Path], bool]


def _is_trtllm_checkpoint(path: Path) -> bool:
    cfg = read_config(path)
    return "quantization" in cfg and "architecture" in cfg


KINDS: tuple[Kind, ...] = (
    # quantkit build-trt's folder: hf/ (evaluate and serve that one) and trtllm-ckpt/ (+ engine/) beside it.
    Kind(KindName.TENSORRT_LLM, "quantkit TensorRT-LLM artifact (hf/, trtllm-ckpt/, engine/)", None, None,
         lambda p: p.is_dir() and (p / "trtllm-ckpt").is_dir()),
    Kind(KindName.GGUF, "GGUF files for llama.cpp", LLAMACPP, LLAMACPP, lambda p: bool(gguf_files(p))),
    Kind(KindName.TRTLLM_ENGINE, "TensorRT-LLM engine", None, TRTLLM,
         lambda p: p.is_dir() and any(p.glob("rank*.engine"))),
    # transformers ignores hf_quant_config.json and would load the quantized weights as plain ones: vLLM only.
    Kind(KindName.MODELOPT, "ModelOpt unified Hugging Face checkpoint", VLLM, TRTLLM,
         lambda p: p.is_dir() and (p / "hf_quant_config.json").exists()),
    Kind(KindName.TRTLLM_CHECKPOINT, "TensorRT-LLM checkpoint (input of trtllm-build)", None, None,
         lambda p: p.is_dir() and _is_trtllm_checkpoint(p)),
    Kind(KindName.COMPRESSED_TENSORS, "compressed-tensors checkpoint", TRANSFORMERS, VLLM,
         lambda p: p.is_dir() and quant_method(p) == "compressed-tensors"),
    Kind(KindName.AWQ, "AutoAWQ checkpoint", TRANSFORMERS, VLLM, lambda p: p.is_dir() and quant_method(p) == "awq"),
    Kind(KindName.GPTQ, "GPTQ checkpoint", TRANSFORMERS, VLLM, lambda p: p.is_dir() and quant_method(p) == "gptq"),
    Kind(KindName.HF_QUANTIZED, "Hugging Face checkpoint with another quantization_config", TRANSFORMERS, VLLM,
         lambda p: p.is_dir() and quant_method(p) is not None),
    Kind(KindName.HF, "Hugging Face checkpoint", TRANSFORMERS, VLLM,
         lambda p: p.is_dir() and (p / "config.json").exists()),
)
BY_NAME = {k.name: k for k in KINDS}


def find(path: Path) -> Kind | None:
    """The kind of ``path``, or None when it is none of them."""
    return next((k for k in KINDS if k.test(path)), None)


def detect(path: Path) -> Kind:
    """The kind of ``path``; a clear error (exit 2) when it does not exist or is no artifact at all."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    kind = find(path)
    if kind is None:
        what = "a file but not a .gguf" if path.is_file() else "neither .gguf files nor a checkpoint (config.json)"
        raise UsageError(f"{path} is {what}",
                         hint="give an artifact folder written by quantkit, a Hugging Face checkpoint or a .gguf file")
    return kind
