"""One model through lm-eval, in the engine that serves it.

* transformers: lm-eval's Hugging Face backend (``HFLM``) on the model quantkit's transformers engine loads (the
  same loader ``eval`` scores perplexity with: compressed-tensors decompressed, float32 on CPU), CPU or GPU;
* vLLM and SGLang: the real server ``smoke`` starts (:mod:`quantkit.engines.serving`), on loopback, asked by lm-eval's
  ``local-completions`` with token ids from a local tokenizer, ``CONCURRENCY`` requests at a time; loglikelihood
  tasks use ``echo`` with log-probabilities, which both serve;
* llama.cpp: llama-server the same way, with text prompts, for generation tasks only (it refuses ``echo``: the
  loglikelihood kinds are refused before anything starts, :func:`quantkit.tasks.evaluate.check_engines`).

lm-eval draws tqdm bars per request kind; :func:`_requests_bar` turns them into one Rich bar of requests with the
time left. Tested with lm-eval 0.4.13, transformers 5.17.0 and llama-server (llama.cpp b6869).
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.engines import logits as engines, serving
from quantkit.engines.logits import EngineOptions
from quantkit.errors import BackendError
from quantkit.formats.names import LLAMACPP, TRANSFORMERS
from quantkit.progress import Reporter
from quantkit.recipe import DEFAULT_STALL_TIMEOUT
from quantkit.tasks.resolve import Task, environment, lm_eval_tasks

CONCURRENCY = 8  # requests in flight to a served engine
SERVED_CTX = 4096  # the context a served engine is started with (llama-server's --ctx-size, vLLM's max-model-len)
SEED = 1234  # lm-eval's default seeds, recorded
_REQUEST_BARS = re.compile(r"^(Running \w+ requests|Requesting API)")


@dataclass
class RunOptions:
    """How the models are run (not what is scored: that is each task's spec)."""

    device: str = "auto"
    python: str | None = None  # a served engine's own Python
    batch_size: int = 16  # transformers: requests per forward pass
    concurrency: int = CONCURRENCY
    timeout: float = 900.0  # a server's start
    stall_timeout: float = DEFAULT_STALL_TIMEOUT  # a server's start without progress (engines/watch.py)
    seed: int = SEED

    def key(self) -> dict[str, Any]:
        """What changes the scores (the baseline cache's key): the seed; batch size and concurrency do not."""
        return {"seed": self.seed}


@dataclass
class Scores:
    """One model's task results: task -> metric -> (value, standard error)."""

    values: dict[str, dict[str, tuple[float, float | None]]]
    samples: dict[str, int]  # items scored per task
    num_fewshot: dict[str, int]
    engine: dict[str, Any]
    seconds: float
    cached: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"values": {t: {m: list(v) for m, v in ms.items()} for t, ms in self.values.items()},
                "samples": self.samples, "num_fewshot": self.num_fewshot, "engine": self.engine,
                "seconds": round(self.seconds, 2)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Scores":
        return cls(values={t: {m: (v[0], v[1]) for m, v in ms.items()} for t, ms in data["values"].items()},
                   samples=data["samples"], num_fewshot=data["num_fewshot"], engine=data["engine"],
                   seconds=data["seconds"], cached=True)


@contextmanager
def _requests_bar(bar: Any) -> Iterator[None]:
    """Forward lm-eval's request bars (disabled or not) to ``bar``: each one's total added, each step advanced."""
    import tqdm.std

    cls = tqdm.std.tqdm
    init, update, iterate = cls.__init__, cls.update, cls.__iter__
    total = [0]

    def mine(self: Any) -> bool:
        return isinstance(getattr(self, "desc", None), str) and bool(_REQUEST_BARS.match(self.desc))

    def on_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.desc = kwargs.get("desc", getattr(self, "desc", ""))
        if mine(self) and self.total:
            total[0] += int(self.total)
            bar.update(total=total[0])

    def on_update(self: Any, n: float | None = 1) -> Any:
        if mine(self):
            bar.advance(n or 0)
        return update(self, n)

    def on_iter(self: Any) -> Iterator[Any]:
        for x in iterate(self):
            if mine(self):
                bar.advance(1)
            yield x

    cls.__init__, cls.update, cls.__iter__ = on_init, on_update, on_iter  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__init__, cls.update, cls.__iter__ = init, update, iterate  # type: ignore[method-assign]


def _parse(res: dict[str, Any], tasks: list[Task]) -> tuple[dict[str, dict[str, tuple[float, float | None]]],
                                                             dict[str, int], dict[str, int]]:
    """lm-eval's results, per task and metric as :func:`quantkit.tasks.resolve._metrics` names them."""
    values: dict[str, dict[str, tuple[float, float | None]]] = {}
    for t in tasks:
        got = res["results"][t.name]
        row = {}
        for metric in t.metrics:
            name, _, filt = metric.partition(",")
            key = f"{name},{filt or 'none'}"
            if key not in got:
                raise BackendError(f"lm-eval reported no {metric} for {t.name} (it reported: "
                                   f"{', '.join(k for k in got if ',' in k)})")
            err = got.get(f"{name}_stderr,{filt or 'none'}")
            row[metric] = (float(got[key]), float(err) if isinstance(err, (int, float)) else None)
        values[t.name] = row
    samples = {t.name: int(res["n-samples"][t.name]["effective"]) for t in tasks}
    shots = {t.name: int(res["n-shot"][t.name]) for t in tasks}
    return values, samples, shots


def _seed(seed: int) -> None:
    """The seeds lm-eval's simple_evaluate sets (Python, NumPy, torch), set the same way."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _evaluate(lm: Any, tasks: list[Task], seed: int) -> Scores:
    """Every task through ``lm``, one lm-eval run per (few-shot, limit) pair the tasks ask for.

    lm-eval's ``evaluate`` is called as its ``simple_evaluate`` calls it (seeds, few-shot count and few-shot seed set
    on each task), without what simple_evaluate adds around it: indexing every task lm-eval ships (seconds) and
    collecting the environment (pip and conda subprocesses), which say nothing about the scores."""
    from lm_eval.evaluator import evaluate

    values: dict[str, dict[str, tuple[float, float | None]]] = {}
    samples: dict[str, int] = {}
    shots: dict[str, int] = {}
    groups: dict[tuple[int | None, int | None], list[Task]] = {}
    for t in tasks:
        groups.setdefault((t.spec.num_fewshot, t.spec.limit), []).append(t)
    for (k, limit), group in groups.items():
        with environment(all(t.local for t in group)):
            built = lm_eval_tasks(group)
            for task in built:
                if k is not None and task.get_config("num_fewshot") != 0:
                    task.set_config(key="num_fewshot", value=k)
                elif task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=seed)
            _seed(seed)
            res = evaluate(lm=lm, task_dict={"tasks": {t.config.task: t for t in built}, "groups": {},
                                             "group_map": {}},
                           limit=limit, bootstrap_iters=1000, log_samples=False, verbosity="ERROR")
        v, s, n = _parse(res, group)
        values.update(v)
        samples.update(s)
        shots.update(n)
    return Scores(values=values, samples=samples, num_fewshot=shots, engine={}, seconds=0.0)


def _transformers(path: Path, tokenizer: Path, tasks: list[Task], opts: RunOptions, rep: Reporter,
                  label: str) -> Scores:
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    with rep.step(f"tasks:load:{label}", f"loading {label} in transformers"):
        engine = engines.open_engine(TRANSFORMERS, path, EngineOptions(ctx=SERVED_CTX, device=opts.device))
    try:
        with environment(local=True):
            lm = HFLM(pretrained=engine.model, tokenizer=AutoTokenizer.from_pretrained(str(tokenizer)),
                      batch_size=opts.batch_size)
        scores = _evaluate(lm, tasks, opts.seed)
        scores.engine = {k: v for k, v in engine.info().items() if k != "numerics_line"}
    finally:
        engine.close()
    return scores


def _served(engine_name: str, path: Path, tokenizer: Path, tasks: list[Task], opts: RunOptions, rep: Reporter,
            label: str) -> Scores:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    server = serving.get(engine_name)
    target = server.targets(path, path.name if path.is_file() else None)[0]
    python = server.python(opts.python)
    serve_opts = serving.ServeOptions(python=opts.python, max_model_len=SERVED_CTX)

    def argv(port: int) -> list[str]:
        return server.argv(target, python, serving.HOST, port, serve_opts)

    log = Path(tempfile.gettempdir()) / "quantkit-tasks" / f"{label.replace('/', '-')}.{engine_name}.log"
    with serving.ServerProcess(engine_name, argv, log_path=log, health_path=server.health_path_for(argv(0)),
                               timeout=opts.timeout, stall_timeout=opts.stall_timeout, reporter=rep) as srv:
        with environment(local=True):
            lm = LocalCompletionsAPI(model=str(target), base_url=f"{srv.url}/v1/completions",
                                     tokenizer_backend="huggingface", tokenizer=str(tokenizer),
                                     num_concurrent=opts.concurrency, max_retries=3, max_length=SERVED_CTX,
                                     tokenized_requests=engine_name != LLAMACPP, seed=opts.seed,
                                     timeout=int(opts.timeout))
        scores = _evaluate(lm, tasks, opts.seed)
    scores.engine = {"engine": engine_name, "served": str(target), "log": str(log),
                     "concurrency": opts.concurrency, **server.log_facts(log.read_text(errors="replace"))}
    return scores


def score(label: str, engine: str, path: Path, tokenizer: Path, tasks: list[Task], opts: RunOptions,
          rep: Reporter) -> Scores:
    """Score ``path`` on every task in ``engine`` (see the module docstring); ``tokenizer`` is the Hugging Face
    folder whose tokenizer lm-eval counts tokens with (the artifact's, or the source's for a GGUF file)."""
    start = time.perf_counter()
    with rep.bar(f"{label} ({engine}): task requests", total=None) as bar, _requests_bar(bar):
        if engine == TRANSFORMERS:
            scores = _transformers(path, tokenizer, tasks, opts, rep, label)
        else:
            scores = _served(engine, path, tokenizer, tasks, opts, rep, label)
    scores.seconds = time.perf_counter() - start
    return scores
