"""Which Python runs each engine: one rule for vLLM, llama.cpp, TensorRT-LLM and ModelOpt.

Each engine's row (:mod:`quantkit.engines.registry`) and the TensorRT-LLM producer (ModelOpt's environment,
:mod:`quantkit.producers.trt.pyenv`) say where their Python may be found, as a :class:`PythonEnv`; this module is
the rule that picks one.

Engines pin their own torch, transformers and compressed-tensors, so each can live in its own environment and be
driven as a subprocess. For an engine, the first of these wins:

1. the Python the user named (``--python``, or ``runtime.python`` / ``smoke.python`` in a recipe);
2. the engine's variable (``QUANTKIT_VLLM_PYTHON``, ``QUANTKIT_LLAMACPP_PYTHON``, ``QUANTKIT_TRTLLM_PYTHON``,
   ``QUANTKIT_TRT_PYTHON`` for ModelOpt);
3. the engine's environment inside the repository, where it has one (``make install-trt`` builds ``.venv-trt``);
4. the interpreter of the engine's console script on PATH (``vllm``, ``trtllm-serve``);
5. this Python.

:func:`find` returns the choice and the rule that made it (for messages and manifests); whether the engine is
really installed there is for the caller to ask (doctor probes it; evaluation refuses early).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FALLBACK = "this Python"


@dataclass(frozen=True)
class PythonEnv:
    """Where one engine's (or ModelOpt's) Python may be found."""

    name: str
    env_var: str
    executable: str = ""  # console script whose interpreter is the engine's Python
    venv: str = ""  # folder in the repository holding the engine's own environment


@dataclass(frozen=True)
class Choice:
    """An engine's Python and the rule that chose it."""

    python: str
    origin: str

    @property
    def fallback(self) -> bool:
        """Nothing named the engine's Python: this one was taken (the engine may not be installed here)."""
        return self.origin == FALLBACK


def _command(name: str) -> str:
    """A Python given by the user, as a path that works from any directory: engines and workers run in other
    working directories (a relative ``--python .venv-trt/bin/python`` passed the check and then was not found by
    the worker). Symbolic links are kept: a virtual environment's python must be called through its own."""
    found = shutil.which(name) or name
    return os.path.abspath(os.path.expanduser(found)) if "/" in found or found.startswith("~") else found


def find(env: PythonEnv, explicit: str | None = None) -> Choice:
    """The Python that runs ``env``'s engine (see the module docstring for the order)."""
    if explicit:
        return Choice(_command(explicit), "--python")
    if os.environ.get(env.env_var):
        return Choice(_command(os.environ[env.env_var]), env.env_var)
    if env.venv and (REPO / env.venv / "bin" / "python").exists():
        return Choice(str(REPO / env.venv / "bin" / "python"), f"{env.venv}/ in the repository")
    if env.executable and (exe := shutil.which(env.executable)):
        if interpreter := script_interpreter(Path(exe)):
            return Choice(interpreter, f"the interpreter of {exe}")
    return Choice(sys.executable, FALLBACK)


def importable_here(module: str) -> bool:
    """Whether ``module`` (an engine's, or ModelOpt's) imports in quantkit's own Python."""
    return importlib.util.find_spec(module) is not None


def script_interpreter(script: Path) -> str | None:
    """The Python named on a console script's ``#!`` line (the environment that script runs in)."""
    try:
        with open(script, "rb") as f:
            first = f.readline().decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    parts = shlex.split(first[2:])
    if parts and Path(parts[0]).name == "env" and len(parts) > 1:
        return parts[1]
    return parts[0] if parts else None
