"""The llama.cpp engine: one GGUF file through llama-cpp-python, fed the protocol's token ids.

Tested with llama-cpp-python 0.3.36 (CPU build) and gguf 0.19.0.

llama-cpp-python loads the model and its context (``n_ctx`` and ``n_batch`` equal to the protocol's window length,
so a window is one ``llama_decode``; ``n_ubatch`` its default 512, flash attention on, both as ``llama-perplexity``
runs: on the tokens ``llama-perplexity --kl-divergence`` scores, perplexity then equals its own to six decimals on
SmolLM2, ``bench/eval_speed.py``, where without flash attention the two differed in the fourth). Each window is
then decoded through llama.cpp's own batch API from an empty KV cache, asking for logits only at the positions
that predict a scored token (the batch's per-token ``logits`` flags): llama.cpp then skips the output layer, and
the last layer's feed-forward, at every other position, and its contiguous output buffer holds exactly the scored
rows, which torch turns into log-probabilities in place (no copy, no new memory) on all cores. Through
``Llama.eval`` every position's logits were computed and copied (``logits_all``: 400 MB a 2048-window for a 49k
vocabulary) where a window scoring its second half needs half of them. Both thread counts are the cores this
process may run on, as ``llama-perplexity``'s default.

The token ids are given directly: llama.cpp's own tokenizer is never used, so its scores are over exactly the
tokens the baseline scored. Layers are offloaded to a GPU when the wheel was built with one and ``--device`` is not
``cpu``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.checkpoint import gguf_files
from quantkit.devices import cores
from quantkit.engines.logits import EngineOptions, LogProbs, Rows, Window
from quantkit.errors import BackendError, UsageError
from quantkit.formats.kinds import Kind
from quantkit.formats.names import LLAMACPP
from quantkit.versions import require, version


class LlamaCppEngine:
    """A GGUF model in llama.cpp; one ``llama_decode`` per window, logits at its scored positions only."""

    name = LLAMACPP

    def __init__(self, path: Path, options: EngineOptions) -> None:
        self.lib = require("llama_cpp", "gguf", "evaluating GGUF files")
        files = gguf_files(path)
        if len(files) != 1:
            raise UsageError(f"{path} holds {len(files)} GGUF files; the llama.cpp engine loads one at a time")
        self.path = files[0]
        self.n_gpu_layers = 0 if options.device == "cpu" else -1
        try:
            self.llm = self.lib.Llama(model_path=str(self.path), n_ctx=options.ctx, n_batch=options.ctx,
                                      n_threads=cores(), n_threads_batch=cores(), flash_attn=True,
                                      n_gpu_layers=self.n_gpu_layers, verbose=False)
        except (ValueError, RuntimeError, OSError) as e:
            raise BackendError(f"llama.cpp could not load {self.path}: {e}",
                               hint="the file may be corrupt, or newer than this llama-cpp-python; check it with "
                                    "`quantkit inspect` and upgrade llama-cpp-python") from None
        self.gpu = bool(self.n_gpu_layers and self.lib.llama_supports_gpu_offload())
        self.n_vocab = self.llm.n_vocab()
        self.batch = self.lib.llama_batch_init(options.ctx, 0, 1)
        for i in range(options.ctx):  # one sequence: every token's only sequence id is 0
            self.batch.seq_id[i][0] = 0
        self.capacity = options.ctx

    def info(self) -> dict[str, Any]:
        return {"engine": self.name, "version": version("llama_cpp_python"), "device": "gpu" if self.gpu else "cpu",
                "model": str(self.path), "threads": cores()}

    def decode(self, w: Window) -> np.ndarray:
        """Run one window from an empty KV cache; its scored rows' logits ([n_scored, vocab] float32), a view of
        llama.cpp's output buffer that the next ``decode`` overwrites."""
        n = len(w.tokens)
        if n > self.capacity:
            raise BackendError(f"a window of {n} tokens does not fit the context of {self.capacity}")
        lib, b = self.lib, self.batch
        b.n_tokens = n
        np.ctypeslib.as_array(b.token, shape=(n,))[:] = w.tokens
        np.ctypeslib.as_array(b.pos, shape=(n,))[:] = np.arange(n)
        np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
        wanted = np.ctypeslib.as_array(b.logits, shape=(n,))
        wanted[:] = 0
        wanted[w.score_from - 1:n - 1] = 1  # row i predicts tokens[score_from + i]
        lib.llama_memory_clear(lib.llama_get_memory(self.llm.ctx), True)
        if (rc := lib.llama_decode(self.llm.ctx, b)) != 0:
            raise BackendError(f"llama_decode failed ({rc}) on window {w.index} of {self.path.name}")
        return np.ctypeslib.as_array(lib.llama_get_logits(self.llm.ctx), shape=(w.n_scored, self.n_vocab))

    def batches(self, windows: Sequence[Window]) -> Iterator[Rows]:
        """Each window's scored rows as float32 log-probabilities (a torch tensor on the host), valid until the next
        is asked for: the log-softmax is taken in place, in llama.cpp's output buffer. A fresh [rows, vocab] tensor
        per window (200 MB for 1,023 rows of a 49k vocabulary) spent 0.04-0.9 s faulting in new pages on the 2-core
        CPU, up to twenty times the log-softmax itself."""
        import torch

        for w in windows:
            logits = torch.from_numpy(self.decode(w))
            yield Rows([w], dense=torch.log_softmax(logits, dim=-1, out=logits))

    def logits(self, windows: Sequence[Window]) -> Iterator[LogProbs]:
        for rows in self.batches(windows):
            assert rows.dense is not None
            yield LogProbs(dense=rows.dense.numpy().copy())  # its own: the next window overwrites the buffer

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.llm.close()
        del self.llm
        gc.collect()


def refuse(path: Path, kind: Kind) -> None:
    """Nothing more to refuse: :func:`quantkit.engines.logits.check_compatible` already asks for GGUF files."""


def load(path: Path, options: EngineOptions) -> LlamaCppEngine:
    return LlamaCppEngine(path, options)
