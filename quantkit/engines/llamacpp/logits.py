"""The llama.cpp engine: one GGUF file through llama-cpp-python, fed the protocol's token ids.

Tested with llama-cpp-python 0.3.36 (CPU build) and gguf 0.19.0.

The model is opened with ``logits_all=True`` so every position's logits are kept, ``n_ctx`` and ``n_batch`` equal
to the protocol's window length, so a window is one ``llama_decode``, and flash attention on, as ``llama-perplexity``
runs (its ``auto``): on the tokens ``llama-perplexity --kl-divergence`` scores, perplexity then equals its own to
six decimals on SmolLM2 (``bench/eval_speed.py``), where without it the two differed in the fourth.
Each window is evaluated from an empty KV cache (``reset`` then ``eval``); the scored rows' log-softmax is taken by
torch on all cores (:meth:`LlamaCppEngine.batches`), not row by row in numpy. The token ids are given directly:
llama.cpp's own tokenizer is never used, so its scores are over exactly the tokens the baseline scored. Layers are
offloaded to a GPU when the wheel was built with one and ``--device`` is not ``cpu``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from quantkit.checkpoint import gguf_files
from quantkit.engines.logits import EngineOptions, LogProbs, Rows, Window
from quantkit.errors import BackendError, UsageError
from quantkit.formats.kinds import Kind
from quantkit.formats.names import LLAMACPP
from quantkit.versions import require, version


class LlamaCppEngine:
    """A GGUF model in llama.cpp; one ``eval`` per window."""

    name = LLAMACPP

    def __init__(self, path: Path, options: EngineOptions) -> None:
        llama_cpp = require("llama_cpp", "gguf", "evaluating GGUF files")
        files = gguf_files(path)
        if len(files) != 1:
            raise UsageError(f"{path} holds {len(files)} GGUF files; the llama.cpp engine loads one at a time")
        self.path = files[0]
        self.n_gpu_layers = 0 if options.device == "cpu" else -1
        try:
            self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=options.ctx, n_batch=options.ctx,
                                       logits_all=True, flash_attn=True, n_gpu_layers=self.n_gpu_layers,
                                       verbose=False)
        except (ValueError, RuntimeError, OSError) as e:
            raise BackendError(f"llama.cpp could not load {self.path}: {e}",
                               hint="the file may be corrupt, or newer than this llama-cpp-python; check it with "
                                    "`quantkit inspect` and upgrade llama-cpp-python") from None
        self.gpu = bool(self.n_gpu_layers and llama_cpp.llama_supports_gpu_offload())

    def info(self) -> dict[str, Any]:
        return {"engine": self.name, "version": version("llama_cpp_python"), "device": "gpu" if self.gpu else "cpu",
                "model": str(self.path)}

    def batches(self, windows: Sequence[Window]) -> Iterator[Rows]:
        """Each window's scored rows as float32 log-probabilities (a torch tensor on the host)."""
        import torch

        for w in windows:
            self.llm.reset()
            self.llm.eval(list(w.tokens))
            logits = torch.from_numpy(self.llm.scores[w.score_from - 1:len(w.tokens) - 1])
            yield Rows([w], dense=torch.log_softmax(logits, dim=-1))

    def logits(self, windows: Sequence[Window]) -> Iterator[LogProbs]:
        for rows in self.batches(windows):
            assert rows.dense is not None
            yield LogProbs(dense=rows.dense.numpy())

    def close(self) -> None:
        self.llm.close()
        del self.llm
        gc.collect()


def refuse(path: Path, kind: Kind) -> None:
    """Nothing more to refuse: :func:`quantkit.engines.logits.check_compatible` already asks for GGUF files."""


def load(path: Path, options: EngineOptions) -> LlamaCppEngine:
    return LlamaCppEngine(path, options)
