"""Which Python runs the ModelOpt step, and what that environment holds.

nvidia-modelopt[hf] 0.47 pins transformers < 5.15 and llm-compressor 0.14 needs >= 5.15, so the two cannot share
one environment; the TensorRT-LLM path runs in its own (``make install`` builds ``.venv-trt`` beside the repo;
NVIDIA's TensorRT-LLM images carry ModelOpt). The environment is chosen by :func:`quantkit.envs.find` (the rule
every engine's Python follows), first match wins:

1. ``runtime.python`` in the recipe (``--python`` on the command line sets it);
2. the ``QUANTKIT_TRT_PYTHON`` environment variable;
3. ``.venv-trt/bin/python`` in the repository quantkit runs from, when it exists;
4. this Python, when ModelOpt is importable here.

The environment is probed with a few lines of standard library (package metadata only, nothing heavy imported),
so a missing package is reported in a second, before any model loads.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from quantkit import envs
from quantkit.errors import BackendError, MissingBackendError, UsageError

# ModelOpt is no engine: it is the quantizer of this producer, and its Python is found by the engines' rule.
MODELOPT = envs.PythonEnv("modelopt", "QUANTKIT_TRT_PYTHON", venv=".venv-trt")
ENV_VAR = MODELOPT.env_var
DEFAULT_VENV = envs.REPO / MODELOPT.venv
REQUIRED = ("nvidia-modelopt", "torch", "transformers", "safetensors")
INSTALL_HINT = (
    f"create the environment with `make install` (or: python3 -m venv {DEFAULT_VENV} && "
    f"{DEFAULT_VENV}/bin/pip install torch && {DEFAULT_VENV}/bin/pip install 'nvidia-modelopt[hf]==0.47.*' "
    "'transformers<5.15'), or point --python / runtime.python / QUANTKIT_TRT_PYTHON at an environment with "
    "nvidia-modelopt[hf]"
)

# Runs in the target environment: versions from package metadata, and whether tensorrt_llm ships the engine
# builder (found by file, because importing tensorrt_llm needs CUDA libraries).
_PROBE = r"""
import json, sys, importlib.util
from importlib import metadata
from pathlib import Path
def v(d):
    try:
        return metadata.version(d)
    except metadata.PackageNotFoundError:
        return None
dists = ("nvidia-modelopt", "torch", "transformers", "safetensors", "accelerate", "tensorrt_llm", "tensorrt")
spec = importlib.util.find_spec("tensorrt_llm")
root = Path(spec.origin).parent if spec and spec.origin else None
print(json.dumps({
    "python": sys.executable,
    "python_version": "%d.%d.%d" % sys.version_info[:3],
    "versions": {d: v(d) for d in dists},
    "tensorrt_llm": root is not None,
    "engine_builder": bool(root and (root / "commands" / "build.py").exists()),
}))
"""


@dataclass
class TrtEnvironment:
    """A probed Python environment for the ModelOpt (and maybe TensorRT-LLM) steps."""

    python: str
    origin: str  # which rule chose it
    python_version: str = ""
    versions: dict[str, str | None] = field(default_factory=dict)
    tensorrt_llm: bool = False
    engine_builder: bool = False

    def manifest(self) -> dict:
        return {"python": self.python, "chosen_by": self.origin, "python_version": self.python_version,
                "versions": {k: v for k, v in self.versions.items() if v}}


def choose(runtime_python: str | None) -> tuple[str, str]:
    """The interpreter to use and the rule that picked it (:func:`quantkit.envs.find`); this Python only when
    ModelOpt imports here."""
    choice = envs.find(MODELOPT, runtime_python)
    if choice.fallback and not envs.importable_here("modelopt"):
        err = MissingBackendError("modelopt", "trt", "The TensorRT-LLM path (ModelOpt quantization and export)")
        err.hint = INSTALL_HINT
        raise err
    return choice.python, choice.origin


def probe(runtime_python: str | None) -> TrtEnvironment:
    """Choose the environment and read what it holds; refuse one without ModelOpt's requirements."""
    python, origin = choose(runtime_python)
    path = Path(python).expanduser()
    if not (path.exists() and os.access(path, os.X_OK)):
        raise UsageError(f"the TensorRT-LLM Python {python} (chosen by {origin}) does not exist or is not executable",
                         hint=INSTALL_HINT)
    try:
        proc = subprocess.run([str(path), "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BackendError(f"cannot run {python} (chosen by {origin}): {e}", hint=INSTALL_HINT) from None
    if proc.returncode != 0:
        raise BackendError(f"{python} (chosen by {origin}) failed to report its packages: "
                           f"{proc.stderr.strip().splitlines()[-1:] or proc.returncode}", hint=INSTALL_HINT)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    env = TrtEnvironment(python=str(path), origin=origin, python_version=info["python_version"],
                         versions=info["versions"], tensorrt_llm=info["tensorrt_llm"],
                         engine_builder=info["engine_builder"])
    require(env)
    return env


def require(env: TrtEnvironment) -> None:
    """Raise one clear error when the environment lacks a package the ModelOpt step imports."""
    missing = [d for d in REQUIRED if not env.versions.get(d)]
    if missing:
        raise BackendError(f"the TensorRT-LLM Python {env.python} (chosen by {env.origin}) lacks "
                           f"{', '.join(missing)}", hint=INSTALL_HINT)
