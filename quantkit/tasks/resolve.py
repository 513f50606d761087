"""A task as the user names it, checked and built before any model loads: a shipped task, a name lm-eval knows, or a
path to a task YAML in lm-eval's own format.

Building a task loads its dataset (lm-eval's ``TaskManager``), so everything that can be wrong with it is found here,
in one line and exit 2: a file that does not parse, a name lm-eval does not know (offline, a hub task whose data is
not cached), data files that are missing, a gate on a metric the task does not report. A YAML's relative
``data_files`` are read relative to the YAML (lm-eval would read them relative to the working folder), and a local
task runs with ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` set, so nothing tries the network.

A task's sha256 covers its configuration as lm-eval holds it (num_fewshot and the data files' paths left out) and its
data: the bytes of a local task's files, the ``datasets`` fingerprint of a hub task's splits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import UsageError
from quantkit.recipe import TaskSpec
from quantkit.tasks import shipped
from quantkit.versions import require

# Output types that need the prompt's log-probabilities (a completions request with echo): llama-server refuses them.
LOGPROB_TYPES = ("loglikelihood", "multiple_choice", "loglikelihood_rolling")
LOCAL_DATASETS = ("json", "csv", "parquet", "text", "arrow")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
# What scores tasks: the package, the extra that installs it, what it is for (require()'s arguments), also for a
# check made before a run starts (scripts/gpu_cases.py skips a case whose recipe scores tasks where it is absent)
LM_EVAL = "lm_eval"
BACKEND = (LM_EVAL, "tasks", "scoring lm-eval tasks")


@dataclass
class Task:
    """One lm-eval task, built and checked: what it reports and its gates."""

    spec: TaskSpec  # as the user or the recipe gave it
    name: str  # lm-eval's name for it
    output_type: str
    metrics: dict[str, bool]  # reported metric ("acc", "exact_match,first-word") -> higher is better
    sha256: str
    config: dict[str, Any] | str  # what lm-eval builds it from again: a config (local) or its registered name
    local: bool
    gates: dict[str, float] = field(default_factory=dict)  # metric -> min recovery (the recipe's, before flags)

    @property
    def needs_logprobs(self) -> bool:
        return self.output_type in LOGPROB_TYPES

    def manifest(self) -> dict[str, Any]:
        """What the manifest and the report say about the task."""
        return {"task": self.name, "spec": self.spec.task, "output_type": self.output_type,
                "metrics": list(self.metrics), "sha256": self.sha256,
                "num_fewshot": self.spec.num_fewshot, "limit": self.spec.limit}


@contextmanager
def environment(local: bool) -> Iterator[None]:
    """lm-eval's logging quieted, and for local tasks the hub turned off, for the block."""
    saved = {k: os.environ.get(k) for k in OFFLINE}
    if local:
        os.environ.update(OFFLINE)
    loggers = [logging.getLogger(n) for n in ("lm_eval", "lm-eval")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _yaml_path(spec: str) -> Path | None:
    """The YAML a spec names: a shipped task's, or a path (one that ends in .yaml/.yml, or exists as a file)."""
    if found := shipped.path(spec):
        return found
    p = Path(spec).expanduser()
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise UsageError(f"task file {p} does not exist")
        return p.resolve()
    return None


def _read_yaml(path: Path) -> dict[str, Any]:
    """A task YAML as lm-eval reads it (``!function``, ``include``), its relative data files made absolute."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        cfg = load_yaml(path, resolve_func=True)
    except Exception as e:  # yaml's parser errors, a bad !function or include: one line either way
        raise UsageError(f"task file {path} does not parse: {_first_line(e)}",
                         hint="a task YAML in lm-eval's format (docs/evaluation.md, 'Task accuracy')") from None
    if not isinstance(cfg.get("task"), str):
        raise UsageError(f"task file {path} names no task (its 'task:' key)",
                         hint="one task per file; lm-eval groups are named by their registered name")
    kwargs = cfg.get("dataset_kwargs") or {}
    files = kwargs.get("data_files")
    if cfg.get("dataset_path") in LOCAL_DATASETS and files:
        def absolute(f: str) -> str:
            return str(path.parent / f) if not Path(f).expanduser().is_absolute() else str(Path(f).expanduser())

        kwargs["data_files"] = {k: absolute(v) if isinstance(v, str) else [absolute(x) for x in v]
                                for k, v in files.items()} if isinstance(files, dict) else \
            absolute(files) if isinstance(files, str) else [absolute(x) for x in files]
        cfg["dataset_kwargs"] = kwargs
    return cfg


def _data_files(cfg: dict[str, Any]) -> list[str]:
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") or []
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
    return list(files)


def _sha256(task: Any, cfg: dict[str, Any] | None) -> str:
    """The task's configuration and data (see the module docstring)."""
    h = hashlib.sha256()
    dumped = task.dump_config()
    dumped.pop("num_fewshot", None)
    (dumped.get("dataset_kwargs") or {}).pop("data_files", None)
    (dumped.get("metadata") or {}).pop("config_source", None)
    h.update(json.dumps(dumped, sort_keys=True, default=str).encode())
    if cfg is not None:
        for f in sorted(_data_files(cfg)):
            h.update(hashlib.sha256(Path(f).read_bytes()).digest())
    else:
        for split in sorted(task.dataset or {}):
            h.update(f"{split}:{task.dataset[split]._fingerprint}".encode())
    return h.hexdigest()


def _metrics(task: Any) -> dict[str, bool]:
    """Every metric the task reports, as lm-eval's results name it (``metric`` or ``metric,filter``)."""
    better = task.higher_is_better()
    return {(m if f.name == "none" else f"{m},{f.name}"): bool(better.get(m, True))
            for f in task._filters for m in task._metric_fn_list}


def match_metric(wanted: str, reported: dict[str, bool]) -> str | None:
    """The reported metric a gate names: its full name, or its name before the filter when that is unambiguous;
    None when it names none."""
    if wanted in reported:
        return wanted
    found = [k for k in reported if k.split(",")[0] == wanted]
    return found[0] if len(found) == 1 else None


def _unmatched(wanted: str, reported: dict[str, bool]) -> str:
    """A gate's metric that names no reported one, as the refusal shows it."""
    found = [k for k in reported if k.split(",")[0] == wanted]
    return repr(wanted) + (f" alone (it reports it under several filters: {', '.join(found)})" if found else "")


def _build(cfg: dict[str, Any] | str, label: str, local: bool) -> list[Any]:
    """The lm-eval Task objects of a config or a registered name (a group gives several), dataset loaded."""
    from lm_eval.tasks import TaskManager

    with environment(local):
        try:
            manager = TaskManager(include_defaults=not local)
            if isinstance(cfg, str) and cfg not in manager.all_tasks:
                raise UsageError(f"lm-eval {_version()} does not know a task called {cfg!r}",
                                 hint=f"quantkit ships {', '.join(shipped.NAMES)}; or give a path to a task YAML")
            built = manager.load([cfg])["tasks"]
        except UsageError:
            raise
        except Exception as e:  # the dataset (missing files, the hub offline), its template: one line
            raise UsageError(f"task {label} could not be built by lm-eval: {_first_line(e)}",
                             hint="a hub task needs the hub (or its dataset cached); a local one its data files")
    return list(built.values())


def _version() -> str:
    from importlib.metadata import version

    return version(LM_EVAL)


class _GateMetricError(UsageError):
    """A spec's gates name metrics its task does not report (every one of them, in one message)."""


@dataclass
class Problem:
    """What is wrong with one task spec: its index in the list given, the spec's key at fault, the error."""

    index: int
    key: str  # "task" (the name or file) or "min_recovery" (a gate's metric)
    error: UsageError


class TaskProblems(UsageError):
    """Every task spec's problem, found together: a recipe with two bad tasks was refused on the first, and the
    second came up only once that was fixed. :func:`quantkit.api.recipe_tasks` names each spec's field and line."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        texts = [p.error.message for p in problems]
        hints = list(dict.fromkeys(p.error.hint for p in problems if p.error.hint))
        super().__init__(texts[0] if len(texts) == 1 else f"{len(texts)} task problems:\n  " + "\n  ".join(texts),
                         hint="; ".join(hints) or None)


def resolve(specs: list[TaskSpec]) -> list[Task]:
    """Build and check each task (see the module docstring); a group name gives one :class:`Task` per member. Every
    spec is checked before any is refused (:class:`TaskProblems`)."""
    require(*BACKEND)
    out: list[Task] = []
    problems: list[Problem] = []
    for i, spec in enumerate(specs):
        try:
            out += _resolve_one(spec)
        except _GateMetricError as e:
            problems.append(Problem(i, "min_recovery", e))
        except UsageError as e:
            problems.append(Problem(i, "task", e))
    if problems:
        raise TaskProblems(problems)
    names = [t.name for t in out]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise UsageError(f"task {dup[0]} is given twice")
    return out


def _resolve_one(spec: TaskSpec) -> list[Task]:
    """One spec's tasks, built and checked."""
    yaml = _yaml_path(spec.task)
    cfg: dict[str, Any] | str = _read_yaml(yaml) if yaml else spec.task
    local = isinstance(cfg, dict)
    out: list[Task] = []
    for task in _build(cfg, spec.task, local):
        name = task.config.task
        metrics = _metrics(task)
        out.append(Task(spec=spec, name=name, output_type=task.OUTPUT_TYPE, metrics=metrics,
                        sha256=_sha256(task, cfg if local else None), config=cfg if local else name, local=local,
                        gates=_gates(spec, metrics, name)))
    return out


def _gates(spec: TaskSpec, metrics: dict[str, bool], name: str) -> dict[str, float]:
    """The spec's ``min_recovery`` per reported metric; every metric it names that the task lacks, refused at once."""
    limits = spec.min_recovery if isinstance(spec.min_recovery, dict) else \
        {m: spec.min_recovery for m in metrics} if spec.min_recovery is not None else {}
    wrong = [_unmatched(m, metrics) for m in limits if match_metric(m, metrics) is None]
    if wrong:
        raise _GateMetricError(f"task {name} does not report the metric{'s' if len(wrong) > 1 else ''} "
                               f"{', '.join(wrong)}; it reports: {', '.join(metrics)}")
    return {match_metric(m, metrics): float(x) for m, x in limits.items()}  # type: ignore[misc]


def lm_eval_tasks(tasks: list[Task]) -> list[Any]:
    """Fresh lm-eval Task objects for one model's run (lm-eval keeps per-run state in them)."""
    out = []
    for t in tasks:
        out += [x for x in _build(t.config, t.name, t.local) if x.config.task == t.name]
    return out
