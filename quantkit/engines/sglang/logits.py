"""The SGLang engine: prompt log-probabilities of the protocol's token windows, through SGLang's own server.

SGLang runs in its own Python (``--python``, ``QUANTKIT_SGLANG_PYTHON``, or this interpreter when SGLang imports
here) as the server :mod:`quantkit.engines.sglang.server` starts, on a free loopback port, with its radix (prefix)
cache off so every window is computed whole, and a context of ``ctx + 7`` tokens (:data:`CONTEXT_MARGIN`: SGLang
refuses a prompt of ``context_length - 6`` tokens or more). Each batch of windows is one
``POST /generate`` with the token ids themselves (``input_ids``: the protocol's tokens, never re-tokenized),
``max_new_tokens`` 1 at temperature 0, ``return_logprob``, ``top_logprobs_num`` k and ``logprob_start_len`` one
before the window's first scored position. ``QUANTKIT_SGLANG_ARGS`` (a JSON list) adds server flags
(``["--tp-size", "2"]``, ``["--attention-backend", "triton"]``).

What SGLang 0.5.17 answers (``managers/scheduler_components/logprob_result_processor.py``
``_process_input_token_logprobs`` and ``_process_input_top_logprobs``; ``managers/tokenizer_manager.py``
``add_logprob_to_meta_info`` and ``detokenize_logprob_tokens``): in each result's ``meta_info``,
``input_token_logprobs`` holds one ``[logprob, token_id, text]`` per prompt token from ``logprob_start_len`` on, the
first with logprob ``null`` ("add None at start, remove last (sampling token)"), so entry ``j`` is log p(token
``start + j`` | the tokens before it); ``input_top_logprobs`` holds, aligned the same way, the top-k
``[logprob, token_id, text]`` of that same distribution (``null`` first). The log-probabilities are a plain
log-softmax of the logits (``layers/logprob_processor.py``: no temperature on prompt positions). Token ids at or
above ``vocab_size - 1`` come back as 0 in ``input_token_logprobs`` (its "clip padded hash values" step); the
log-probability next to them is still the real token's.

Batches go out :data:`IN_FLIGHT` at a time (a thread each), and each answer becomes arrays in a few whole-array
conversions (no step per token in Python but the JSON decoding itself), so the server, not quantkit, sets the pace.

So, as with vLLM: perplexity and top-1 agreement are exact (the actual token's log-probability is returned for
every position), KL divergence is a lower bound computed over the top-k bins plus one bin for the rest of the
vocabulary (:func:`quantkit.evaluation.metrics.kld_rows`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.engines import client, registry
from quantkit.engines.logits import EngineOptions, LogProbs, Window
from quantkit.engines.serving import HOST, ServeOptions, ServerProcess
from quantkit.engines.sglang import loads
from quantkit.engines.sglang.server import SERVER
from quantkit.errors import BackendError, UsageError
from quantkit.formats.kinds import Kind
from quantkit.formats.names import SGLANG

ROW = registry.get(SGLANG)
PYTHON_ENV = ROW.env_var
ARGS_ENV = "QUANTKIT_SGLANG_ARGS"
TIMEOUT_ENV = "QUANTKIT_SGLANG_TIMEOUT"
BATCH = 8  # windows per /generate request (SGLang schedules them together)
IN_FLIGHT = 3  # requests sent before the first answer is read: the server never waits on quantkit's parsing
DEFAULT_TIMEOUT = 900.0  # seconds to health: the first start compiles SGLang's JIT kernels
REQUEST_TIMEOUT = 1800.0
# SGLang 0.5.17 takes a prompt only when it is shorter than max_req_input_len = (context_length - 1) - 5
# (managers/tp_worker.py get_worker_info; managers/utils.py validate_input_length): a window of ctx tokens needs a
# context of ctx + 7. With ctx + 1, every eval of the H200 run of 2026-12-02 was refused ("Input length (2048
# tokens) exceeds the maximum allowed length (2043 tokens)", bench/results/h200/sglang/).
CONTEXT_MARGIN = 7
# The server's own environment: a window of exactly max_position_embeddings tokens needs CONTEXT_MARGIN positions
# more (the scheduler's reserve, and the single sampled token, thrown away), which SGLang refuses unless told it is
# intended.
SERVER_ENV = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}


def find_python(explicit: str | None) -> str:
    """SGLang's interpreter, refused early when it cannot run the worker (:meth:`quantkit.engines.registry.Engine.require_python`)."""
    return ROW.require_python(explicit)


def refuse(path: Path, kind: Kind) -> None:
    """What SGLang cannot score at all, by its load table (:mod:`quantkit.engines.sglang.loads`), before any load."""
    if why := loads.refusal(path):
        raise UsageError(why, hint="evaluate it with --engine vllm (or auto)")


def server_args() -> list[str]:
    """``QUANTKIT_SGLANG_ARGS``: extra server flags, a JSON list of strings."""
    raw = os.environ.get(ARGS_ENV)
    if not raw:
        return []
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UsageError(f"{ARGS_ENV} is not valid JSON: {e}") from None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise UsageError(f"{ARGS_ENV} must be a JSON list of strings (server flags), e.g. [\"--tp-size\", \"2\"]")
    return args


def generate_request(windows: Sequence[Window], topk: int) -> dict[str, Any]:
    """The ``/generate`` body for a batch of windows (one list per window in every per-request field)."""
    if any(w.score_from < 1 for w in windows):
        raise ValueError("a window's first scored position needs one token of context")
    return {"input_ids": [list(w.tokens) for w in windows],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": [True] * len(windows),
            "logprob_start_len": [start(w) for w in windows],
            "top_logprobs_num": [topk] * len(windows)}


def request_batches(windows: Sequence[Window]) -> list[Sequence[Window]]:
    """The windows in the groups one ``/generate`` request carries (:data:`BATCH` each), in order."""
    return [windows[i:i + BATCH] for i in range(0, len(windows), BATCH)]


def prefill_request(windows: Sequence[Window]) -> dict[str, Any]:
    """The same ``/generate`` body without log-probabilities: the forward passes alone, what bounds scoring."""
    body = generate_request(windows, 1)
    return {"input_ids": body["input_ids"], "sampling_params": body["sampling_params"]}


def start(window: Window) -> int:
    """``logprob_start_len`` for a window: SGLang's first entry there is null, so one before the first scored token."""
    return window.score_from - 1


def parse_result(result: Mapping[str, Any], window: Window, topk: int) -> LogProbs:
    """One window's rows from one ``/generate`` result, checked against the window's own tokens."""
    meta = result.get("meta_info") or {}
    tokens = meta.get("input_token_logprobs")
    tops = meta.get("input_top_logprobs")
    first = start(window)
    expected = len(window.tokens) - first
    if not isinstance(tokens, list) or not isinstance(tops, list):
        raise BackendError(f"SGLang answered window {window.index} without input_token_logprobs/input_top_logprobs "
                           f"(keys: {sorted(meta)})")
    if len(tokens) != expected or len(tops) != expected:
        raise BackendError(f"SGLang answered window {window.index} with {len(tokens)} token and {len(tops)} top-k "
                           f"entries from position {first}; {expected} expected")
    # Entry 0 is the null one, at the token before the first scored position; the rest become arrays at once.
    entries = _numbers(tokens[1:], 2)
    if entries is None:  # a null log-probability, or an entry that is not [logprob, id, ...]: find which
        entries = np.array([e[:2] if isinstance(e, list) and len(e) > 1 and None not in e[:2] else [np.nan] * 2
                            for e in tokens[1:]], dtype=np.float64)
    target, got = entries[:, 0], entries[:, 1]
    bad = np.flatnonzero(np.isnan(target) | ((got != window.targets) & (got != 0)))
    if len(bad):
        pos = first + 1 + int(bad[0])
        raise BackendError(f"SGLang's entry for position {pos} of window {window.index} is {tokens[1 + bad[0]][:2]}, "
                           f"not token {window.tokens[pos]} with a log-probability")
    ids, values = _top_arrays(tops[1:], topk, window, first)
    over = np.flatnonzero(target > values[:, 0] + 1e-3)
    if len(over):
        pos = first + 1 + int(over[0])
        raise BackendError(f"SGLang's log-probability of token {window.tokens[pos]} at position {pos} of window "
                           f"{window.index} ({target[over[0]]:.4f}) exceeds its own top-1 ({values[over[0], 0]:.4f})")
    return LogProbs(ids=ids, values=values, target=target.astype(np.float32))


def _numbers(entries: list[Any], ndim: int) -> np.ndarray | None:
    """``[logprob, id, text]`` entries (nested ``ndim - 1`` deep) as float64 [..., 2], in one conversion; None
    when they are ragged or hold a null."""
    table = np.array(entries, dtype=object)
    if table.ndim != ndim or table.shape[-1] < 2:
        return None
    try:
        return table[..., :2].astype(np.float64)
    except (TypeError, ValueError):
        return None


def _top_arrays(rows: list[Any], topk: int, window: Window, first: int) -> tuple[np.ndarray, np.ndarray]:
    """The top-k ids and log-probabilities of every scored position, most likely first; -1/-inf pad a position
    that came with fewer than k, none is an error."""
    width = max((len(r) for r in rows if r), default=0)
    empty = [j for j, r in enumerate(rows) if not r]
    if empty or width == 0:
        j = empty[0] if empty else 0
        raise BackendError(f"SGLang returned no top-k log-probabilities at position {first + 1 + j} of window "
                           f"{window.index}")
    table = _numbers(rows, 3)
    if table is None:  # positions with fewer entries than others: padded one by one
        pad = [float("-inf"), -1]
        table = np.array([[e[:2] for e in r] + [pad] * (width - len(r)) for r in rows], dtype=np.float64)
    order = np.argsort(-table[:, :, 0], axis=1, kind="stable")[:, :topk]
    values = np.take_along_axis(table[:, :, 0], order, axis=1)
    ids = np.take_along_axis(table[:, :, 1], order, axis=1).astype(np.int64)
    if width < topk:
        values = np.pad(values, ((0, 0), (0, topk - width)), constant_values=-np.inf)
        ids = np.pad(ids, ((0, 0), (0, topk - width)), constant_values=-1)
    return ids, values.astype(np.float32)


class SglangEngine:
    """An SGLang server holding the model; windows go in as token ids, top-k log-probs come out."""

    name = SGLANG

    def __init__(self, path: Path, options: EngineOptions) -> None:
        if options.device == "cpu":
            raise UsageError("the SGLang engine runs on a GPU; --device cpu cannot be honoured",
                             hint="use --engine transformers for CPU evaluation")
        self.path = path
        self.topk = options.topk
        self.python = find_python(options.python)
        fd, log = tempfile.mkstemp(prefix="quantkit-sglang-", suffix=".log")  # kept when the server fails
        os.close(fd)
        self.log_path = Path(log)
        self._failed = False
        opts = ServeOptions(python=self.python, max_model_len=options.ctx + CONTEXT_MARGIN)
        extra = ["--disable-radix-cache", *server_args()]

        def argv(port: int) -> list[str]:
            return SERVER.argv(path, self.python, HOST, port, opts) + extra

        timeout = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT)
        self.server = ServerProcess(SGLANG, argv, log_path=self.log_path, env=SERVER_ENV,
                                    health_path=SERVER.health_path, timeout=timeout,
                                    stall_timeout=options.stall_timeout)
        try:
            self.server.__enter__()
            self._info = client.get_json(self.server.url + "/server_info", timeout=120)
        except BaseException:
            self._failed = True
            self.close()
            raise

    def info(self) -> dict[str, Any]:
        facts = SERVER.log_facts(self.log_path.read_text(errors="replace")) if self.log_path.exists() else {}
        return {"engine": self.name, "version": self._info.get("version"), "device": "cuda",
                "model": str(self.path), "python": self.python, "topk": self.topk,
                "attention_backend": self._info.get("attention_backend"),
                "quantization": facts.get("quantization") or self._info.get("quantization"),
                "tp": self._info.get("tp_size")}

    def logits(self, windows: Sequence[Window]) -> Iterator[LogProbs]:
        """Batches of windows, IN_FLIGHT requests at a time so the server computes the next while the last one's
        answer is read; results come back in order."""
        batches = request_batches(windows)
        pool = ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="quantkit-sglang")
        try:
            futures = [pool.submit(self._generate, batch) for batch in batches]
            for batch, future in zip(batches, futures):
                results = future.result()
                for w, result in zip(batch, results):
                    try:
                        yield parse_result(result, w, self.topk)
                    except BackendError:
                        self._failed = True
                        raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def request_seconds(self, windows: Sequence[Window], logprobs: bool = True) -> float:
        """Seconds SGLang takes to answer the requests :meth:`logits` sends for ``windows`` (the same batches,
        :data:`IN_FLIGHT` at a time), decoded but not converted: its own prompt-logprob throughput on these tokens;
        without ``logprobs``, the forward passes alone. For ``bench/eval_speed.py``, beside quantkit's scoring."""
        def ask(batch: Sequence[Window]) -> Any:
            body = generate_request(batch, self.topk) if logprobs else prefill_request(batch)
            return client.post_json(self.server.url + "/generate", body, timeout=REQUEST_TIMEOUT)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="quantkit-sglang") as pool:
            list(pool.map(ask, request_batches(windows)))
        return time.perf_counter() - t0

    def _generate(self, batch: Sequence[Window]) -> list[Any]:
        """One ``/generate`` request for a batch of windows: its list of results, checked for length."""
        try:
            results = client.post_json(self.server.url + "/generate", generate_request(batch, self.topk),
                                       timeout=REQUEST_TIMEOUT)
        except BackendError as e:
            self._failed = True
            raise (self.server.died("/generate") or e) from None
        if not isinstance(results, list) or len(results) != len(batch):
            self._failed = True
            raise BackendError(f"SGLang answered a batch of {len(batch)} windows with "
                               f"{len(results) if isinstance(results, list) else 'no list of'} results")
        return results

    def close(self) -> None:
        self.server.stop()
        if not self._failed:
            self.log_path.unlink(missing_ok=True)


def load(path: Path, options: EngineOptions) -> SglangEngine:
    return SglangEngine(path, options)
