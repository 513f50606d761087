"""llama.cpp's own ``llama-perplexity --kl-divergence``: running it, reading its summary, and the tokens it scores
as quantkit windows, so quantkit's figures can be checked against it on the very same tokens.

Tested with llama.cpp b11312's ``llama-perplexity`` and gguf 0.19.0.

``llama-perplexity`` tokenizes a text, cuts it into chunks of ``n_ctx`` tokens, puts BOS in place of a chunk's first
token only where the GGUF asks llama.cpp to add one (``tokenizer.ggml.add_bos_token``; a file without it is taken
to add one), and scores
the second half of each chunk: the ``n_ctx - 1 - n_ctx/2`` tokens after position ``n_ctx/2``. With
``--kl-divergence-base FILE`` it stores the tokens (and the baseline's log-probabilities) in FILE, which a later
``--kl-divergence`` run reads back. quantkit's protocol differs (every token scored, BOS first where the baseline's
tokenizer has one: :mod:`quantkit.evaluation.protocol`), so the two are compared on :func:`windows`, read from that
file. Used by ``bench/eval_speed.py`` and ``tests/test_gguf_llamacpp_eval.py``.
"""

from __future__ import annotations

import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantkit.engines.logits import Window

MAGIC = b"_logits_"
SUMMARY = {"ppl": r"Mean PPL\(Q\)\s*:\s*([\d.]+)", "ppl_base": r"Mean PPL\(base\)\s*:\s*([\d.]+)",
           "kld": r"Mean\s+KLD:\s*([\d.]+)", "top1": r"Same top p:\s*([\d.]+)"}
ATTEMPTS = 3


@dataclass
class Run:
    """One ``llama-perplexity`` run: the summary figures asked for (``top1`` in percent, as it prints), its wall
    seconds and CPU seconds (user + system), and its log."""

    figures: dict[str, float]
    wall_s: float
    cpu_s: float
    log: str


def run(args: list[str], want: tuple[str, ...], purpose: str) -> Run:
    """Run ``llama-perplexity ARGS`` and read the figures ``want`` (keys of :data:`SUMMARY`) from its summary.

    llama.cpp b11312's tools log through a worker thread whose queue is not flushed at exit (common/log.cpp leaks
    the logger on purpose, ggml-org/llama.cpp#22142), so now and then the last lines, the summary among them, never
    reach the pipe although the run succeeded (about 1 run in 20 here): such a run is repeated, twice at most.
    """
    from quantkit.producers.gguf import tools

    for _ in range(ATTEMPTS):
        t0, c0 = time.perf_counter(), _children_cpu()
        out = tools.run("llama-perplexity", args, purpose=purpose)
        wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
        log = out.stdout + out.stderr
        found = {key: re.search(SUMMARY[key], log) for key in want}
        if all(found.values()):
            return Run({key: float(m.group(1)) for key, m in found.items() if m}, wall, cpu, log)
    missing = ", ".join(k for k, m in found.items() if not m)
    raise RuntimeError(f"llama-perplexity printed no {missing} in {ATTEMPTS} runs; the last one ended:\n{log[-2000:]}")


def _children_cpu() -> float:
    """CPU seconds of this process's finished children: what a run cost, however busy the machine was."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def read_base(path: Path) -> tuple[int, list[list[int]]]:
    """``n_ctx`` and the token chunks of a ``--kl-divergence-base`` file (magic, n_ctx, n_vocab, n_chunk, tokens)."""
    data = path.read_bytes()
    if data[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{path} is not a llama-perplexity --kl-divergence-base file")
    n_ctx, _n_vocab, n_chunk = (int(x) for x in np.frombuffer(data, dtype="<i4", count=3, offset=len(MAGIC)))
    tokens = np.frombuffer(data, dtype="<i4", count=n_ctx * n_chunk, offset=len(MAGIC) + 12)
    return n_ctx, [tokens[k * n_ctx:(k + 1) * n_ctx].tolist() for k in range(n_chunk)]


def bos_to_add(gguf_file: Path) -> int | None:
    """The BOS id llama.cpp puts first in each chunk of ``gguf_file`` (None where its ``add_bos_token`` is false)."""
    import gguf

    fields = gguf.GGUFReader(gguf_file).fields
    add = fields.get("tokenizer.ggml.add_bos_token")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    if (add is not None and not add.contents()) or bos is None:
        return None
    return int(bos.contents())


def windows(base_file: Path, gguf_file: Path) -> list[Window]:
    """The chunks of ``base_file`` as llama-perplexity scores them with ``gguf_file``: BOS first where the file adds
    one, the second half scored (row ``n_ctx/2`` on, predicting token ``n_ctx/2 + 1`` on)."""
    n_ctx, chunks = read_base(base_file)
    bos = bos_to_add(gguf_file)
    return [Window(index=k, tokens=tuple(c) if bos is None else (bos, *c[1:]), score_from=n_ctx // 2 + 1)
            for k, c in enumerate(chunks)]
