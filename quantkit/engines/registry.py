"""The engines: one :class:`Engine` row each, the only place an engine is described.

What an engine does is said once, by :mod:`quantkit.formats.names` (``EVALUATING``, ``SERVING``); a row finds its
modules from that and its name: ``quantkit.engines.<name>.logits`` scores token windows for ``quantkit eval``
(:mod:`quantkit.engines.logits` says the shape and opens it), ``quantkit.engines.<name>.server``'s ``SERVER``
starts its OpenAI-compatible server for ``quantkit smoke`` (:func:`quantkit.engines.serving.get`). A row says where
its Python is found (:mod:`quantkit.envs`), the distribution and module ``doctor`` asks that Python for, whether it
needs a CUDA GPU, and the version it was tested with. Which artifact kinds an engine evaluates and serves is said
once, by the kinds table (:mod:`quantkit.formats.kinds`); :meth:`Engine.evaluates` and :meth:`Engine.serves` read
it. Engine modules are imported only when used.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from quantkit import envs
from quantkit.errors import MissingEngineError, UsageError
from quantkit.formats import kinds, names
from quantkit.formats.names import LLAMACPP, SGLANG, TRANSFORMERS, TRTLLM, VLLM


@dataclass(frozen=True)
class Engine:
    """One engine: where its code is, which Python runs it, and what doctor asks of it."""

    name: str
    python: envs.PythonEnv | None  # where the engine's own Python is found; None: it runs in quantkit's
    dist: str  # the distribution whose version doctor reports as the engine's
    module: str  # the import name that says the engine is installed in a Python
    gpu: bool  # needs a CUDA GPU
    tested: str | None  # the version of ``dist`` its modules were tested with (or written for); None: never run

    label: str = ""  # how messages spell it (vLLM, SGLang); the name when empty

    @property
    def logits(self) -> str | None:
        """The module whose load(path, options) scores token windows; None: not an evaluation engine."""
        return f"quantkit.engines.{self.package}.logits" if self.name in names.EVALUATING else None

    @property
    def server(self) -> str | None:
        """The module whose SERVER starts the engine's server; None: not a serving engine."""
        return f"quantkit.engines.{self.package}.server" if self.name in names.SERVING else None

    @property
    def package(self) -> str:
        """The engine's own folder under quantkit/engines/: its name as a Python identifier (llama.cpp: llamacpp)."""
        return self.name.replace(".", "")

    def find_python(self, explicit: str | None = None) -> envs.Choice:
        """The engine's own Python and the rule that chose it (:func:`quantkit.envs.find`)."""
        assert self.python is not None, f"{self.name} runs in quantkit's own Python"
        return envs.find(self.python, explicit)

    def require_python(self, explicit: str | None = None) -> str:
        """The engine's Python for a worker quantkit starts in it (eval's), refused in one line before any work: a
        path that does not exist, or this interpreter when the engine does not import here."""
        choice = self.find_python(explicit)
        label = self.label or self.name
        if not choice.fallback:
            if shutil.which(choice.python) is None and not Path(choice.python).is_file():
                raise UsageError(f"{label}'s Python {choice.python!r} (from {choice.origin}) does not exist",
                                 hint=f"pass --python /path/to/{self.name}-env/bin/python or set {self.env_var}")
            return choice.python
        if envs.importable_here(self.module):
            return choice.python
        raise MissingEngineError(f"the {label} engine needs {label}, which is not installed in this environment",
                         hint=f"pass --python /path/to/{self.name}-env/bin/python (or set {self.env_var}) to use the "
                              f"Python of an environment where {label} is installed")

    @property
    def env_var(self) -> str:
        """The variable that names the engine's Python (``QUANTKIT_VLLM_PYTHON``...)."""
        assert self.python is not None, f"{self.name} runs in quantkit's own Python"
        return self.python.env_var

    def evaluates(self) -> tuple[str, ...]:
        """The artifact kinds ``quantkit eval --engine auto`` scores with this engine."""
        return tuple(k.name for k in kinds.KINDS if k.evaluate == self.name)

    def serves(self) -> tuple[str, ...]:
        """The artifact kinds ``quantkit smoke --engine auto`` serves with this engine."""
        return tuple(k.name for k in kinds.KINDS if k.serve == self.name)


ENGINES: tuple[Engine, ...] = (
    Engine(TRANSFORMERS, python=None, dist="transformers", module="transformers", gpu=False, tested="5.17.0"),
    Engine(LLAMACPP, python=envs.PythonEnv(LLAMACPP, "QUANTKIT_LLAMACPP_PYTHON"),
           dist="llama_cpp_python", module="llama_cpp", gpu=False, tested="0.3.36"),
    Engine(VLLM, python=envs.PythonEnv(VLLM, "QUANTKIT_VLLM_PYTHON", executable="vllm"),
           dist="vllm", module="vllm", gpu=True, tested="0.26.0", label="vLLM"),
    Engine(TRTLLM, python=envs.PythonEnv(TRTLLM, "QUANTKIT_TRTLLM_PYTHON", executable="trtllm-serve"),
           dist="tensorrt_llm", module="tensorrt_llm", gpu=True, tested=None),
    # Written for SGLang 0.5.17 (quantkit.engines.sglang.loads holds what that version's source says it loads).
    Engine(SGLANG, python=envs.PythonEnv(SGLANG, "QUANTKIT_SGLANG_PYTHON", executable="sglang"),
           dist="sglang", module="sglang", gpu=True, tested=None, label="SGLang"),
)
BY_NAME = {e.name: e for e in ENGINES}


def get(name: str) -> Engine:
    """The row of the engine called ``name``."""
    return BY_NAME[name]


def evaluating_engine(path: Path) -> str:
    """The engine ``eval --engine auto`` picks for a path: its kind's (llama.cpp for GGUF, vLLM for ModelOpt exports,
    which transformers would load silently wrong, else transformers). An artifact whose engine reads a folder inside
    it (:attr:`quantkit.formats.kinds.Kind.reads`) is refused, naming that folder: the engine is given what it reads."""
    kind = kinds.detect(path)
    if kind.evaluate is None or kind.reads:
        raise UsageError(f"{path} holds {kind.label}, which cannot be evaluated as it is",
                         hint=f"evaluate its {kind.reads}/ folder: quantkit eval {kind.folder(path)}" if kind.reads
                         else "evaluate the hf/ folder of a TensorRT-LLM artifact (with --engine vllm)")
    return kind.evaluate


def serving_engine(path: Path) -> str:
    """The engine that serves an artifact (``smoke --engine auto``): its kind's; refused, naming the folder, for an
    artifact whose engine reads a folder inside it (as :func:`evaluating_engine`)."""
    kind = kinds.detect(path)
    if kind.serve is None or kind.reads:
        raise UsageError(f"{path} holds {kind.label}, which no engine serves as it is",
                         hint=f"serve its {kind.reads}/ folder: quantkit smoke {kind.folder(path)} --engine "
                              f"{kind.serve}" if kind.reads
                         else "serve the hf/ or engine/ folder of a TensorRT-LLM artifact, or pass --engine")
    return kind.serve


def engine_unavailable(name: str, python: str | None) -> str | None:
    """Why the engine ``name`` cannot serve here (None when it can): not installed in its Python, or no GPU."""
    import importlib.util
    import subprocess
    import sys

    row = BY_NAME[name]
    py = row.find_python(python).python
    if py in (None, sys.executable):
        if importlib.util.find_spec(row.module) is None:
            return f"{name} is not installed here (pass smoke.python / --python for its environment)"
    elif subprocess.run([py, "-c", f"import {row.module}"], capture_output=True).returncode != 0:
        return f"{name} does not import in {py}"
    if row.gpu and py in (None, sys.executable):
        try:
            import torch

            if not torch.cuda.is_available():
                return f"{name} needs a CUDA GPU and none is visible"
        except ImportError:
            return "torch is not installed"
    return None
