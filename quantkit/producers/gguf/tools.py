"""llama.cpp's command-line tools: where they are, which llama.cpp they were built from, and running them.

``make install`` builds llama.cpp once from the source the pinned llama-cpp-python vendors
(``scripts/build_llama_tools.sh``: the sdist's sha256 checked): ``llama-imatrix``, ``llama-quantize``,
``llama-perplexity`` and ``llama-server`` with the shared libraries they run on, which llama-cpp-python (installed
without a llama.cpp of its own) loads too. It caches them in ``<cache>/llama-tools/<version>-b<build>-<key>/``
(``<cache>``: :func:`quantkit.cache.root`; ``<key>``: the CPU flags and the script) with a ``BUILD.json`` saying
what they are, and links them into the virtual environment (``bin``, and the package's ``llama_cpp/lib``). So
library and tools are one llama.cpp build, and :func:`describe` can say so.

A tool is looked for, in order, in ``$QUANTKIT_LLAMACPP_BIN`` (a folder), beside the running Python (the venv's
``bin``, where ``make install`` links them), in the make cache (a build for the installed llama-cpp-python), and
on ``PATH``. The tools found on ``PATH`` may be any llama.cpp: :func:`describe` reports their version and commit
and whether they are known to match the library.

llama.cpp's HF -> GGUF converter (``convert_hf_to_gguf.py``, its ``conversion`` package and its own ``gguf-py``) is
put by ``make install`` from the same sdist into ``<cache>/llama-convert/<version>-b<build>/``
(``scripts/build_llama_convert.sh``, with a ``BUILD.json``); :func:`require_converter` finds it there or in
``$QUANTKIT_LLAMACPP_CONVERT`` (a folder holding ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``).

Running a tool (:func:`run`) captures its output; a failure is one :class:`~quantkit.errors.BackendError` with
the output's last lines, a missing tool one :class:`~quantkit.errors.MissingToolError` (exit code 1) saying how
to get it. Ctrl-C or SIGTERM while a tool runs kills it before the interrupt propagates.

Tested with llama.cpp b11312 (0c1e57098), vendored by llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit import cache
from quantkit.errors import BackendError, MissingToolError, exit_text
from quantkit.versions import version as dist_version

ENV_VAR = "QUANTKIT_LLAMACPP_BIN"
TOOLS = ("llama-imatrix", "llama-quantize", "llama-perplexity", "llama-server")
# make install's cache root is quantkit's (:func:`quantkit.cache.root`), so QUANTKIT_CACHE_DIR moves both.
CACHE = cache.root() / "llama-tools"
CONVERT_ENV_VAR = "QUANTKIT_LLAMACPP_CONVERT"
CONVERT_CACHE = cache.root() / "llama-convert"
CONVERTER = "convert_hf_to_gguf.py"
TAIL_LINES = 12
# ``version: 0.5.0-dev (build 11312, commit 0c1e57098)``; older llama.cpp printed ``version: 11312 (0c1e57098)``.
_VERSION = re.compile(r"version:\s*(?:(?P<release>\S+)\s*\(build (?P<build>\d+), commit (?P<commit>\w+)\)"
                      r"|(?P<old_build>\d+)\s*\((?P<old_commit>\w+)\))")


@dataclass(frozen=True)
class Found:
    """Where a tool was found and how (``env``, ``venv``, ``cache`` or ``path``)."""

    path: Path
    how: str


def _candidates() -> list[tuple[Path, str]]:
    folders: list[tuple[Path, str]] = []
    if os.environ.get(ENV_VAR):
        folders.append((Path(os.environ[ENV_VAR]).expanduser(), "env"))
    if sys.prefix != sys.base_prefix:  # a virtual environment: make install links the tools into its bin
        folders.append((Path(sys.executable).parent, "venv"))
    lib = dist_version("llama_cpp_python")
    if lib and CACHE.is_dir():
        builds = sorted(CACHE.glob(f"{lib}-*/bin"), key=lambda p: p.stat().st_mtime, reverse=True)
        folders += [(b, "cache") for b in builds]
    return folders


def find(tool: str) -> Found | None:
    """Where ``tool`` is (see the module docstring for the order), or None.

    ``$QUANTKIT_LLAMACPP_BIN``, when set, is the only place looked at: a user who names a folder means it.
    """
    for folder, how in _candidates():
        exe = folder / tool
        if exe.is_file() and os.access(exe, os.X_OK):
            return Found(exe, how)
        if how == "env":
            return None
    on_path = shutil.which(tool)
    return Found(Path(on_path), "path") if on_path else None


def require(tool: str, purpose: str) -> Path:
    """The path of ``tool``, or :class:`MissingToolError` saying what needed it and how to get it."""
    found = find(tool)
    if found is None:
        where = f"in ${ENV_VAR} ({os.environ[ENV_VAR]})" if os.environ.get(ENV_VAR) else \
            f"beside {sys.executable}, in {CACHE} or on PATH"
        raise MissingToolError(f"{purpose} needs llama.cpp's {tool}, which is not installed {where}",
                               hint="run `make install` (it builds llama.cpp's tools from the llama-cpp-python "
                                    f"sdist), or set {ENV_VAR} to a folder holding {tool}")
    return found.path


def find_converter() -> Found | None:
    """The folder of llama.cpp's converter: ``$QUANTKIT_LLAMACPP_CONVERT`` when set (the only place then looked
    at), else the newest make-cache folder for the installed llama-cpp-python."""
    def complete(folder: Path) -> bool:
        return (folder / CONVERTER).is_file() and (folder / "conversion").is_dir() and (folder / "gguf-py").is_dir()

    if os.environ.get(CONVERT_ENV_VAR):
        folder = Path(os.environ[CONVERT_ENV_VAR]).expanduser()
        return Found(folder, "env") if complete(folder) else None
    lib = dist_version("llama_cpp_python")
    if lib and CONVERT_CACHE.is_dir():
        for folder in sorted(CONVERT_CACHE.glob(f"{lib}-*"), key=lambda p: p.stat().st_mtime, reverse=True):
            if complete(folder) and (folder / "BUILD.json").is_file():
                return Found(folder, "cache")
    return None


def require_converter(purpose: str) -> Found:
    """llama.cpp's converter folder, or :class:`MissingToolError` saying what needed it and how to get it."""
    found = find_converter()
    if found is None:
        where = f"in ${CONVERT_ENV_VAR} ({os.environ[CONVERT_ENV_VAR]})" if os.environ.get(CONVERT_ENV_VAR) else \
            f"in {CONVERT_CACHE}"
        raise MissingToolError(f"{purpose} needs llama.cpp's {CONVERTER}, which is not installed {where}",
                               hint="run `make install` (it puts llama.cpp's converter from the llama-cpp-python "
                                    f"sdist into the cache), or set {CONVERT_ENV_VAR} to a folder holding "
                                    f"{CONVERTER}, conversion/ and gguf-py/")
    return found


def describe_converter() -> dict[str, Any] | None:
    """Where the converter is, how it was found, and the llama.cpp commit its BUILD.json names (for manifests)."""
    found = find_converter()
    if found is None:
        return None
    entry: dict[str, Any] = {"tool": CONVERTER, "path": str(found.path), "found_in": found.how}
    build = build_json(found.path / "BUILD.json")
    if build is None or not {"build_number", "commit", "llama_cpp_python"} <= set(build):
        return entry
    entry.update({"build_number": build["build_number"], "commit": build["commit"][:9],
                  "built_for": f"llama-cpp-python {build['llama_cpp_python']}"})
    return entry


def build_info(exe: Path) -> dict[str, Any] | None:
    """The ``BUILD.json`` that ``make install`` wrote beside a tool (following the venv's link), if any."""
    return build_json(exe.resolve().parent.parent / "BUILD.json")


def build_json(path: Path) -> dict[str, Any] | None:
    """A ``BUILD.json`` of ``make install``'s, or None where there is none to use: read as a cache entry is
    (:func:`quantkit.cache.read_json`), since it lies in quantkit's cache or in a folder a variable names, where a
    FIFO at its name hung ``doctor`` and a GGUF build's manifest for ever; no JSON object is none either."""
    data = cache.read_json(path)
    return data if isinstance(data, dict) else None


def reported_version(exe: Path, timeout: float = 30.0) -> dict[str, Any]:
    """What ``TOOL --version`` says: llama.cpp's build number, commit and release (0.5.0-dev for b11312)."""
    try:
        proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{exe} --version: {e}"}
    text = proc.stdout + proc.stderr
    m = _VERSION.search(text)
    if not m:
        return {"error": f"{exe} --version printed no version: {text.strip()[-200:]}"}
    out: dict[str, Any] = {"build_number": int(m["build"] or m["old_build"]), "commit": m["commit"] or m["old_commit"]}
    if m["release"]:
        out["release"] = m["release"]
    return out


def describe_one(tool: str) -> dict[str, Any] | None:
    """Where ``tool`` is, how it was found, the llama.cpp build and commit it reports, and which llama-cpp-python
    its build was made for (None when it is not found)."""
    found = find(tool)
    if found is None:
        return None
    entry: dict[str, Any] = {"tool": tool, "path": str(found.path), "found_in": found.how}
    build = build_info(found.path)
    if tool != "llama-quantize":
        entry.update(reported_version(found.path))
    elif build:  # llama-quantize has no --version: its build is its folder's
        entry.update({"build_number": build["build_number"], "commit": build["commit"][:9]})
    else:
        entry["error"] = "llama-quantize has no --version, and no BUILD.json from `make install` is beside it"
    entry["built_for"] = f"llama-cpp-python {build['llama_cpp_python']}" if build else None
    return entry


def describe() -> dict[str, Any]:
    """Every tool (:func:`describe_one`), which are missing, and whether all are known to come from the same
    llama.cpp source as the installed llama-cpp-python (``doctor`` prints this)."""
    lib = dist_version("llama_cpp_python")
    found = {tool: describe_one(tool) for tool in TOOLS}
    missing = [t for t, e in found.items() if e is None]
    builds = {e["built_for"] for e in found.values() if e}
    return {"tools": found, "missing": missing, "llama_cpp_python": lib,
            "matches_library": bool(lib) and not missing and builds == {f"llama-cpp-python {lib}"}}


def summary() -> tuple[str, str, str | None]:
    """``doctor``'s line about the tools: (``ok`` or ``warn``, message with version and commit, hint)."""
    d = describe()
    found = {t: e for t, e in d["tools"].items() if e}
    hint = f"run `make install`, or set {ENV_VAR} to a folder holding {', '.join(TOOLS)}"
    if not found:
        return ("warn", "llama.cpp's tools are not installed: GGUF --imatrix cannot quantize, and smoke falls back to "
                        "llama-cpp-python's server", hint)
    builds = sorted({f"b{e['build_number']} ({e['commit']})" if "commit" in e else "unknown build"
                     for e in found.values()})
    folders = sorted({str(Path(e["path"]).parent) + f" ({e['found_in']})" for e in found.values()})
    message = f"{', '.join(found)}: llama.cpp {', '.join(builds)} in {', '.join(folders)}"
    if d["missing"]:
        return "warn", f"{message}; missing: {', '.join(d['missing'])}", hint
    if not d["matches_library"]:
        return ("warn", f"{message}; not known to be built from the llama.cpp of llama-cpp-python "
                        f"{d['llama_cpp_python']} (library and tools may disagree)", hint)
    return "ok", f"{message}, built from the llama.cpp of llama-cpp-python {d['llama_cpp_python']}", None


def run(tool: str, args: list[str], *, purpose: str, timeout: float | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``tool args`` to completion; its output is returned, or shown (last lines) in the error on failure."""
    exe = require(tool, purpose)
    argv = [str(exe), *args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout,
                              stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        raise BackendError(f"{tool} did not finish within {timeout:.0f}s ({purpose})") from None
    except OSError as e:
        raise BackendError(f"could not run {exe}: {e}",
                           hint=f"rebuild the tools with `make install`, or point {ENV_VAR} at working ones") from None
    if proc.returncode != 0:
        raise BackendError(f"{tool} failed ({purpose}): it {exit_text(proc.returncode)}; last lines:\n"
                           f"{tail(proc.stdout + proc.stderr)}", hint=f"the command was: {' '.join(argv)}")
    return proc


def tail(text: str, lines: int = TAIL_LINES) -> str:
    """The last non-empty lines of a tool's output."""
    kept = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])
