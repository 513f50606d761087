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

    ``evaluate`` is the engine that scores it (None: it cannot be scored), ``serve`` the engine that serves it
    (None: nothing serves it), both reading the folder ``reads`` names inside it where it names one: the one rule
    for which folder of an artifact an engine reads, asked through :meth:`folder` (``quantkit run`` and its plan
    evaluate and serve that folder; ``quantkit eval`` and ``smoke`` are given it).
    """

    name: str
    label: str
    evaluate: str | None
    serve: str | None
    test: Callable[[Path], bool]
    reads: str = ""  # the folder inside the artifact that its engines read; "": the artifact itself

    def folder(self, path: Path) -> Path:
        """The folder of the artifact at ``path`` that its engines read."""
        return path / self.reads if self.reads else path


def _is_trtllm_checkpoint(path: Path) -> bool:
    cfg = read_config(path)
    return "quantization" in cfg and "architecture" in cfg


KINDS: tuple[Kind, ...] = (
    # quantkit build-trt's folder: hf/, ModelOpt's unified checkpoint, which vLLM evaluates and serves (a ModelOpt
    # export of an algorithm vLLM has no method for, such as INT4-AWQ, it refuses itself: kernels.vllm_refusal; a
    # `none` export's hf/ is a plain checkpoint, scored where its own row says: producers.trt.hf_kind), and
    # trtllm-ckpt/ (+ engine/) beside it for TensorRT-LLM.
    Kind(KindName.TENSORRT_LLM, "quantkit TensorRT-LLM artifact (hf/, trtllm-ckpt/, engine/)", VLLM, VLLM,
         lambda p: p.is_dir() and (p / "trtllm-ckpt").is_dir(), reads="hf"),
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
