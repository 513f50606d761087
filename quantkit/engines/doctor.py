"""``quantkit doctor``: what is installed where, and whether an engine can read an artifact before it tries.

The most common failure of a quantized release is an artifact the serving engine will not load, often because
the engine pins an older compressed-tensors than the one that wrote the artifact. Doctor compares the two: the
version recorded in the artifact (``quantization_config.version``, else the manifest's ``versions``) against
the one installed in the engine's own Python, and asks that compressed-tensors, in a small subprocess, whether
it knows the artifact's ``format`` strings (its ``CompressionFormat`` enum) and accepts its quantization
schemes (its pydantic ``QuantizationConfig``, which forbids fields it does not know). GGUF artifacts are checked
the same way against the file types the engine's llama.cpp knows. A short table lists the incompatibilities
that are known but not visible in those schemas. An FP4 W4A4 artifact gets one more line: the arithmetic vLLM will
run it with on the engine's GPU, from its compute capability (:mod:`quantkit.engines.numerics`).

Every Python environment (quantkit's own, or the engine's ``--python``) is queried by a subprocess running
:data:`PROBE`, so nothing heavy is imported into quantkit and an engine environment that crashes on import is
reported rather than fatal. Tested with compressed-tensors 0.19.0 and 0.17.0, llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from quantkit import integrity
from quantkit.checkpoint import Fp4, quantization_config, read_config
from quantkit.engines import numerics, registry, serving
from quantkit.engines.serving import Server
from quantkit.engines.sglang import loads as sglang_loads
from quantkit.engines.transformers import dense_copy
from quantkit.errors import QuantkitError, UsageError
from quantkit.formats import kinds
from quantkit.formats.names import LLAMACPP, SGLANG, VLLM, KindName
from quantkit.manifest import MANIFEST, read_manifest

# What ``doctor`` reports for an environment: quantkit's backends and the engines.
DISTS = ("torch", "transformers", "accelerate", "llmcompressor", "compressed-tensors", "safetensors", "gguf",
         "llama_cpp_python", "autoawq", "nvidia-modelopt", "vllm", "tensorrt_llm", "sglang", "sglang-kernel",
         "flashinfer-python", "numpy", "tokenizers")
MODULES = ("torch", "transformers", "llmcompressor", "compressed_tensors", "gguf", "llama_cpp", "vllm",
           "modelopt", "tensorrt_llm", "sglang")
# What else doctor asks an engine's Python: the distributions whose declared requirements it reports (their pins),
# and modules whose presence matters to that engine (a transformers that defines a model SGLang registers itself).
REQUIRES_OF = {SGLANG: ("sglang",)}
ENGINE_MODULES = {SGLANG: (sglang_loads.CONFLICTING_MODULE,), VLLM: ("flashinfer",)}  # FlashInfer: MXFP4's W4A4
PROBE_TIMEOUT = 300.0
NUMERICS_CHECK = "fp4 numerics"  # the check saying which arithmetic a W4A4 FP4 artifact will get

# Runs inside the environment being asked (``python -c PROBE REQUEST_JSON``); standard library at the top, each
# heavy import guarded, one JSON line out.
PROBE = r'''
import json, sys, importlib.util
from importlib import metadata
req = json.loads(sys.argv[1])
out = {"python": sys.executable, "python_version": sys.version.split()[0], "versions": {}, "modules": {}}
for d in req["dists"]:
    try:
        out["versions"][d] = metadata.version(d)
    except metadata.PackageNotFoundError:
        pass
for m in req["modules"]:
    try:
        out["modules"][m] = importlib.util.find_spec(m) is not None
    except Exception:  # a submodule's parent that fails to import: the module is not there for the engine either
        out["modules"][m] = False
out["requires"] = {}
for d in req.get("requires_of", []):
    try:
        out["requires"][d] = metadata.requires(d) or []
    except metadata.PackageNotFoundError:
        pass
if req.get("torch"):
    try:
        import torch
        cuda = torch.cuda.is_available()
        out["torch"] = {"version": torch.__version__, "cuda_available": cuda, "cuda": torch.version.cuda,
                        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                                   if cuda else [],
                        "capabilities": [list(torch.cuda.get_device_capability(i))
                                         for i in range(torch.cuda.device_count())] if cuda else []}
    except Exception as e:
        out["torch"] = {"error": "%s: %s" % (type(e).__name__, e)}
qc = req.get("quantization_config")
if qc is not None:
    ct = {}
    try:
        import compressed_tensors
        from compressed_tensors.config import CompressionFormat
        from compressed_tensors.quantization import QuantizationConfig
        ct["version"] = getattr(compressed_tensors, "__version__", None) or metadata.version("compressed-tensors")
        ct["formats"] = [f.value for f in CompressionFormat]
        try:
            QuantizationConfig.model_validate(qc)
            ct["valid"] = True
        except Exception as e:
            ct["valid"] = False
            ct["error"] = str(e)[:3000]
    except Exception as e:
        ct["error"] = "%s: %s" % (type(e).__name__, e)
    out["compressed_tensors"] = ct
if req.get("gguf_file_types"):
    try:
        import llama_cpp
        out["llama_cpp_file_types"] = {int(getattr(llama_cpp, n)): n[len("LLAMA_FTYPE_MOSTLY_"):]
                                       for n in dir(llama_cpp) if n.startswith("LLAMA_FTYPE_MOSTLY_")}
        out["llama_cpp_file_types"][0] = "F32"
    except Exception as e:
        out["llama_cpp_error"] = "%s: %s" % (type(e).__name__, e)
print("QUANTKIT_PROBE " + json.dumps(out))
'''


@dataclass
class Check:
    """One finding: ``ok``, ``warn`` (may still load: smoke goes on) or ``fail`` (will not: smoke stops)."""

    name: str
    status: str
    message: str
    hint: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "message": self.message, "hint": self.hint}


@dataclass
class Skew:
    """A known incompatibility between an artifact kind and an engine that the schemas alone do not show."""

    engine: str
    applies: Callable[[dict[str, Any]], bool]
    message: str
    hint: str


KNOWN_SKEWS: list[Skew] = [
    Skew(VLLM, lambda a: a.get("format") == "awq" and a.get("bits") not in (None, 4),
         "vLLM's AWQ kernels read 4-bit AutoAWQ checkpoints only",
         "write the AWQ artifact in compressed-tensors format (quantkit awq --format compressed-tensors)"),
    Skew(VLLM, lambda a: a.get("format") == "gptq" and a.get("bits") not in (None, 2, 3, 4, 8),
         "vLLM's GPTQ kernels read 2, 3, 4 and 8-bit GPTQ checkpoints only", "quantize with --bits 4 or 8"),
    Skew(LLAMACPP, lambda a: a.get("format") not in (None, KindName.GGUF),
         "llama.cpp serves GGUF files only", "convert with quantkit gguf, or serve with --engine vllm"),
    Skew(VLLM, lambda a: a.get("format") == KindName.GGUF,
         "quantkit serves GGUF files with llama.cpp (vLLM's GGUF support is experimental and single-file)",
         "use --engine llama.cpp"),
]


@dataclass(frozen=True)
class VersionSkew:
    """A known incompatibility of an engine release with a library of its environment, for some architectures:
    the engine's version starts with ``engine_version``, the library is at least ``library_at_least``."""

    engine: str
    engine_version: str
    library: str
    library_at_least: tuple[int, ...]
    architectures: tuple[str, ...]
    message: str
    hint: str

    def check(self, engine: str, versions: dict[str, Any], architecture: str | None) -> Check | None:
        """The failing check when this skew applies to an engine environment (its versions) and an architecture."""
        lib = versions.get(self.library)
        if (engine != self.engine or architecture not in self.architectures
                or not str(versions.get(engine_dist(engine)) or "").startswith(self.engine_version)
                or not lib or _vtuple(lib) < self.library_at_least):
            return None
        return Check("known incompatibility", "fail",
                     self.message.format(arch=architecture, engine=versions.get(engine_dist(engine)), lib=lib),
                     hint=self.hint)


def engine_dist(engine: str) -> str:
    return registry.get(engine).dist


# Measured on the H200 (bench/results/h200/vlm/): vLLM 0.26.0's pixtral module, which its LLaVA-family models import,
# imports PixtralRotaryEmbedding, renamed PixtralVisionRotaryEmbedding in transformers 5.17.0; the architecture
# cannot even be inspected, quantized or not.
VERSION_SKEWS: tuple[VersionSkew, ...] = (
    VersionSkew(VLLM, "0.26.", "transformers", (5, 17),
                ("LlavaForConditionalGeneration", "Mistral3ForConditionalGeneration"),
                "vLLM {engine} cannot load {arch} with transformers {lib}: its pixtral module imports "
                "PixtralRotaryEmbedding, which transformers renamed PixtralVisionRotaryEmbedding",
                "score it with quantkit eval --engine transformers; serve it with a vLLM release made for this "
                "transformers, or with transformers < 5.17 in vLLM's environment"),
)


@dataclass
class Report:
    """Everything doctor found, as data (``--json`` prints :meth:`to_json`)."""

    quantkit: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    artifact: dict[str, Any] | None = None
    checks: list[Check] = field(default_factory=list)
    dists: tuple[str, ...] = DISTS  # the distributions whose versions were asked, in display order
    parts: list["Report"] = field(default_factory=list)  # a release folder: each artifact's, against its engine

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[Check]:
        """The failed checks, a release's artifacts' named by their folder."""
        own = [c for c in self.checks if c.status == "fail"]
        return own + [replace(c, name=f"{Path(p.artifact['path']).name}: {c.name}") if p.artifact else c
                      for p in self.parts for c in p.failures()]

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "quantkit": self.quantkit, "engine": self.engine, "artifact": self.artifact,
                "checks": [c.to_json() for c in self.checks], "artifacts": [p.to_json() for p in self.parts]}


def probe(python: str | None = None, env: dict[str, str] | None = None, *, torch: bool = True,
          quantization_config: dict[str, Any] | None = None, gguf_file_types: bool = False,
          engine: str | None = None, timeout: float = PROBE_TIMEOUT) -> dict[str, Any]:
    """Ask a Python environment what it has installed (and, given an artifact's config, whether it reads it; given
    an engine, that engine's declared requirements and the modules it cares about).

    Returns ``{"error": ...}`` instead of raising when that Python cannot be run or crashes.
    """
    python = python or sys.executable
    req = {"dists": list(DISTS), "modules": [*MODULES, *ENGINE_MODULES.get(engine or "", ())], "torch": torch,
           "quantization_config": quantization_config, "gguf_file_types": gguf_file_types,
           "requires_of": list(REQUIRES_OF.get(engine or "", ()))}
    try:
        proc = subprocess.run([python, "-c", PROBE, json.dumps(req)], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return {"python": python, "error": f"{python} not found"}
    except PermissionError:
        return {"python": python, "error": f"{python} is not executable"}
    except subprocess.TimeoutExpired:
        return {"python": python, "error": f"{python} did not answer within {timeout:.0f}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("QUANTKIT_PROBE "):
            return json.loads(line[len("QUANTKIT_PROBE "):])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
    return {"python": python, "error": f"{python} exited with code {proc.returncode}: {tail}"}


def _vtuple(v: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", (v or "").split("+")[0])[:3])


def _architecture(path: Path) -> str | None:
    archs = read_config(path if path.is_dir() else path.parent).get("architectures") or [None]
    return archs[0]


def describe_artifact(path: Path) -> dict[str, Any]:
    """What doctor needs to know about an artifact: its kind, scheme, and the library versions that wrote it."""
    from quantkit.inspection import checkpoint_quantization, describe_gguf_files

    kind = kinds.detect(path)
    root = path if path.is_dir() else path.parent
    written: dict[str, str] = {}
    named: Any = None  # the manifest's name for the scheme (a mix: W4A16_ASYM+W8A16)
    if (root / MANIFEST).exists():
        try:
            manifest = read_manifest(root)
            written, named = manifest.versions, manifest.quantization.get("scheme")
        except QuantkitError:  # an unreadable manifest is verify's business; doctor reads the configs
            written = {}
    info: dict[str, Any] = {"path": str(path), "kind": kind.name, "architecture": _architecture(path)}
    if kind.name == KindName.GGUF:
        info["format"] = str(KindName.GGUF)
        info["gguf"] = describe_gguf_files(path)
        info["written_with"] = {k: written[k] for k in ("gguf", "llama_cpp_python") if k in written}
        return info
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path / 'config.json'} is unreadable: {e}") from None
    info.update(checkpoint_quantization(path))  # every config group, not the first alone
    if isinstance(named, str):
        info["scheme"] = named
    q = quantization_config(cfg)
    if kind.name == KindName.COMPRESSED_TENSORS:
        info["quantization_config"] = q
        ct_written = q.get("version") or written.get("compressed-tensors")
        info["written_with"] = {"compressed-tensors": ct_written,
                                "source": "config.json" if q.get("version") else "quantkit.json"}
        info["formats"] = sorted({f for f in [q.get("format"), *[(g or {}).get("format") for g in
                                  (q.get("config_groups") or {}).values()]] if f})
    return info


def _installed_check(engine: Server, env_info: dict[str, Any]) -> Check:
    if "error" in env_info:
        return Check("engine python", "fail",
                     f"the {engine.name} engine's Python could not be asked: {env_info['error']}",
                     hint="pass --python PATH of the environment where the engine is installed")
    if not env_info.get("modules", {}).get(engine.module):
        return Check("engine installed", "fail",
                     f"{engine.name} ({engine.module}) is not installed in {env_info.get('python')}",
                     hint=f"pass --python PATH (or set {engine.python_env_var}) to the engine's environment, "
                          "or --env PYTHONPATH=... where it is installed with pip --target")
    version = env_info.get("versions", {}).get(engine.dist, "?")
    return Check("engine installed", "ok", f"{engine.name} {version} in {env_info.get('python')}")


def _ct_checks(art: dict[str, Any], engine_name: str, env_info: dict[str, Any]) -> list[Check]:
    checks: list[Check] = []
    ct = env_info.get("compressed_tensors") or {}
    writer = (art.get("written_with") or {}).get("compressed-tensors")
    if "version" not in ct:
        checks.append(Check("compressed-tensors", "fail",
                            f"{engine_name}'s Python cannot import compressed-tensors "
                            f"({ct.get('error', 'not installed')})",
                            hint="install the compressed-tensors the engine pins in its environment"))
        return checks
    reader = ct["version"]
    art["read_with"] = {"compressed-tensors": reader}
    if writer and _vtuple(reader) < _vtuple(writer):
        checks.append(Check("compressed-tensors version", "warn",
                            f"written with compressed-tensors {writer}, {engine_name} reads it with {reader} (older): "
                            "loading depends on the older library knowing everything below"))
    else:
        checks.append(Check("compressed-tensors version", "ok",
                            f"written with {writer or 'an unrecorded version'}, read with {reader}"))
    unknown = [f for f in art.get("formats", []) if f not in ct.get("formats", [])]
    if unknown:
        checks.append(Check("format", "fail",
                            f"format {', '.join(map(repr, unknown))} is unknown to compressed-tensors {reader} in "
                            f"{engine_name}'s environment (it knows: {', '.join(ct.get('formats', []))})",
                            hint="write the artifact with a format that version knows (pin compressed-tensors when "
                                 "quantizing), or upgrade the engine"))
    else:
        checks.append(Check("format", "ok", f"{', '.join(art.get('formats', [])) or 'no format'} known to {reader}"))
    if ct.get("valid") is False:
        checks.append(Check("scheme", "fail",
                            f"compressed-tensors {reader} rejects the artifact's quantization_config: "
                            f"{ct.get('error')}",
                            hint="a field or value newer than that version: quantize with the engine's "
                                 "compressed-tensors, or upgrade the engine"))
    else:
        checks.append(Check("scheme", "ok", f"{art.get('scheme')} ({art.get('strategy')}) validates with {reader}"))
    return checks


def _gguf_checks(art: dict[str, Any], env_info: dict[str, Any]) -> list[Check]:
    known = {int(k): v for k, v in (env_info.get("llama_cpp_file_types") or {}).items()}
    if not known:
        return [Check("gguf file types", "warn",
                      f"could not list llama.cpp's file types: {env_info.get('llama_cpp_error', 'unknown')}")]
    try:
        from gguf import LlamaFileType
    except ImportError:
        return [Check("gguf file types", "warn", "gguf-py is not installed: file types not compared")]
    checks = []
    for g in art.get("gguf", []):
        if "error" in g:
            checks.append(Check(f"gguf {g['file']}", "fail", f"{g['file']} is not a readable GGUF: {g['error']}",
                                hint="re-create it (quantkit gguf ... --force)"))
            continue
        name = g.get("type")
        ids = [ft.value for ft in LlamaFileType if ft.name.removeprefix("MOSTLY_") == name]
        if ids and ids[0] not in known:
            checks.append(Check(f"gguf {g['file']}", "fail", f"file type {name} is unknown to the engine's llama.cpp",
                                hint="upgrade llama-cpp-python, or choose another --type"))
        else:
            checks.append(Check(f"gguf {g['file']}", "ok", f"file type {name} known to the engine's llama.cpp"))
    return checks


def _numerics_check(found: Fp4, info: dict[str, Any], path: Path) -> Check:
    """Which arithmetic vLLM will run a W4A4 FP4 artifact with on the engine's first GPU (weight-only below FP4
    tensor cores: a warning, since its scores are then not what the checkpoint asks for); with no GPU, what this
    machine scores instead."""
    t = info.get("torch") or {}
    caps, devices = t.get("capabilities") or [], t.get("devices") or []
    if not t.get("cuda_available") or not caps:
        cpu = numerics.DENSE_COPY if dense_copy.needed(path) else numerics.EMULATED
        return Check(NUMERICS_CHECK, "ok", numerics.line(found, cpu, "no GPU here: quantkit eval --engine "
                                                                      "transformers"))
    cap = (int(caps[0][0]), int(caps[0][1]))
    label = numerics.of_gpu(found, cap, bool(info.get("modules", {}).get("flashinfer")))
    where = f"vLLM on {devices[0] if devices else 'this GPU'} (compute capability {cap[0]}.{cap[1]})"
    return Check(NUMERICS_CHECK, "warn" if label == numerics.MARLIN_WEIGHT_ONLY else "ok",
                 numerics.line(found, label, where))


def _finding_check(f: sglang_loads.Finding) -> Check:
    return Check(f.name, f.status, f.message, f.hint)


def _llama_tools_check() -> Check:
    """llama.cpp's tools (llama-quantize for GGUF importance matrices, llama-server for smoke): which build."""
    from quantkit.producers.gguf import tools

    status, message, hint = tools.summary()
    return Check("llama.cpp tools", status, message, hint)


def check(path: Path | None, engine_name: str = "auto", *, python: str | None = None,
          env: dict[str, str] | None = None, include_quantkit: bool = True) -> Report:
    """Run doctor: quantkit's environment, the engine's (when an engine or artifact is given), the artifact; for a
    release folder, each of its artifacts against its engine (``--engine``, or each one's own)."""
    if path is not None and (roots := integrity.release_artifacts(Path(path))):
        report = check(None, "", include_quantkit=include_quantkit)  # quantkit's own environment, once
        report.parts = [check(r, engine_name, python=python, env=env, include_quantkit=False) for r in roots]
        return report
    report = Report()
    art = describe_artifact(Path(path)) if path is not None else None
    report.artifact = art
    if engine_name == "auto":
        engine_name = registry.serving_engine(Path(path)) if path is not None else ""
    engine = serving.get(engine_name) if engine_name else None
    engine_python = engine.python(python) if engine else None
    is_ct = bool(art and art["kind"] == KindName.COMPRESSED_TENSORS)
    is_gguf = bool(art and art["kind"] == KindName.GGUF)
    # What to ask the engine's environment; when it is quantkit's own, one probe answers for both.
    ask = {"torch": engine is not None and engine.name != LLAMACPP,
           "quantization_config": art["quantization_config"] if art is not None and is_ct else None,
           "gguf_file_types": is_gguf, "engine": engine.name if engine else None}
    same_env = engine_python in (None, sys.executable) and not env
    if include_quantkit:
        report.quantkit = probe(**{**ask, "torch": True}) if same_env else probe(torch=True)
    if include_quantkit or engine_name == LLAMACPP:
        report.checks.append(_llama_tools_check())
    if engine is None:
        return report
    info = report.quantkit if same_env and report.quantkit is not None else probe(engine_python, env, **ask)
    report.engine = {"name": engine.name, "python": engine_python, "env": dict(env or {}),
                     "version": (info.get("versions") or {}).get(engine.dist), **info}
    report.checks.append(_installed_check(engine, info))
    if engine.name in (VLLM, SGLANG) and "error" not in info:
        t = info.get("torch") or {}
        if not t.get("cuda_available"):
            report.checks.append(Check("cuda", "fail", f"{'vLLM' if engine.name == VLLM else 'SGLang'} needs a "
                                       f"CUDA GPU; torch "
                                       f"{t.get('version', '?')} in {engine_python} sees none"
                                       f"{': ' + t['error'] if t.get('error') else ''}",
                                       hint="run on a GPU machine"))
        else:
            report.checks.append(Check("cuda", "ok", f"torch {t.get('version')} (CUDA {t.get('cuda')}): "
                                                     f"{', '.join(t.get('devices', []))}"))
    if art is not None and engine.name == VLLM and "error" not in info and (found := numerics.w4a4(Path(art["path"]))):
        report.checks.append(_numerics_check(found, info, Path(art["path"])))
    if engine.name == SGLANG and "error" not in info and info.get("modules", {}).get(engine.module):
        report.engine["pins"] = info.get("requires", {}).get(engine.dist, [])
        report.checks.extend(_finding_check(f) for f in sglang_loads.env_findings(
            report.engine["pins"], info.get("versions", {}), info.get("modules", {}), report.engine["version"]))
    if art is not None:
        if engine.name == SGLANG:
            report.checks.extend(_finding_check(f) for f in sglang_loads.findings(Path(art["path"])))
        for skew in KNOWN_SKEWS:
            if skew.engine == engine.name and skew.applies(art):
                report.checks.append(Check("known incompatibility", "fail", skew.message, hint=skew.hint))
        if "error" not in info:
            found = (v.check(engine.name, info.get("versions") or {}, art.get("architecture")) for v in VERSION_SKEWS)
            report.checks.extend(c for c in found if c is not None)
        if is_ct and "error" not in info:
            report.checks.extend(_ct_checks(art, engine.name, info))
        if is_gguf and engine.name == LLAMACPP and "error" not in info:
            report.checks.extend(_gguf_checks(art, info))
    return report
