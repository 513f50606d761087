"""GGUF files in llama.cpp's own OpenAI-compatible server, ``llama-server``; llama-cpp-python's as a fallback.

``llama-server`` is what llama.cpp users deploy, so it is what the smoke test runs: the binary that ``make
install`` builds from the llama.cpp source llama-cpp-python vendors (found by
:func:`quantkit.producers.gguf.tools.find`: ``$QUANTKIT_LLAMACPP_BIN``, the venv, the make cache, ``PATH``). It
answers ``/health`` (503 while loading, 200 when ready) and chats with the GGUF's own chat template (``--jinja``,
the template stored in the file; without one llama.cpp falls back to its default, which the facts note). One
slot (``--parallel 1``) and the context asked for: a smoke test needs no more KV cache. Its log is kept at trace
verbosity (``--log-verbosity 4``), which names the build, the file type and the chat template it uses.

A vision-language artifact's text files are served with the vision side its manifest names
(``quantization.mmproj``, :func:`mmproj`: ``--mmproj FILE``), and then take images in OpenAI ``image_url`` parts.

Where the binary is missing, the server is llama-cpp-python's (``python -m llama_cpp.server``, which has no
``/health``: it binds its port only once the model is loaded, so ``/v1/models`` is its health check), and the
run's facts say it was the fallback. A ``--server-cmd`` running ``llama_cpp.server`` is checked the same way.

Tested with llama.cpp b11312 (0c1e57098) and llama-cpp-python[server] 0.3.36 on CPU. One server per ``.gguf``
file: an artifact folder holding several quantization types is smoke-tested file by file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from quantkit.engines.serving import ServeOptions, Server
from quantkit.errors import UsageError
from quantkit.formats.names import LLAMACPP
from quantkit.manifest import MANIFEST, read_manifest
from quantkit.producers.gguf import tools

DEFAULT_CTX = 2048
PYTHON_SERVER = "llama_cpp.server"
FALLBACK = f"{PYTHON_SERVER} (llama-cpp-python), the fallback: llama-server is not installed"


def gguf_chat_template(path: Path) -> str | None:
    """The ``tokenizer.chat_template`` a GGUF file carries (None if it has none or cannot be read)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
        return None if field is None else field.contents()
    except Exception:  # an unreadable file: the server reports it properly when it tries to load it
        return None


def mmproj(target: Path) -> Path | None:
    """The vision side (mmproj file) a GGUF artifact's manifest names for its text files, or None (a text model,
    or a file outside a quantkit artifact)."""
    root = target.parent
    if target.suffix != ".gguf" or not (root / MANIFEST).is_file():
        return None
    record = read_manifest(root).quantization.get("mmproj")
    if not isinstance(record, dict) or not record.get("file"):
        return None
    path = root / record["file"]
    if not path.is_file():
        raise UsageError(f"{root}'s manifest names the mmproj file {record['file']}, which is not there",
                         hint="quantkit verify checks the artifact's files; make it again with quantkit gguf")
    return path


def _is_python_server(argv: list[str]) -> bool:
    return any(PYTHON_SERVER in a for a in argv)


class LlamaCppServer(Server):
    name = LLAMACPP
    health_path = "/health"
    no_tensor_parallel = ("it spreads layers over every visible GPU by itself; to split rows instead, give "
                          "llama-server its own split-mode option (row) through --server-arg")

    def targets(self, artifact: Path, file: str | None) -> list[Path]:
        if artifact.is_file():
            return [artifact]
        files = sorted(artifact.glob("*.gguf"))
        if file:
            chosen = [f for f in files if f.name == Path(file).name]
            if not chosen:
                raise UsageError(f"{artifact} has no GGUF file named {file!r}",
                                 hint=f"choose one of: {', '.join(f.name for f in files) or '(none)'}")
            return chosen
        if not files:
            raise UsageError(f"{artifact} holds no .gguf file")
        return files

    def has_chat_template(self, target: Path) -> bool:
        return True  # the GGUF's template, else llama.cpp's default (noted in the run's facts)

    def takes_images(self, target: Path) -> bool:
        return mmproj(target) is not None

    def command(self, target: Path, python: str, host: str, port: int, opts: ServeOptions) -> list[str]:
        ctx = str(opts.max_model_len or DEFAULT_CTX)
        server = tools.find("llama-server")
        vision = mmproj(target)
        if vision is not None:  # the fallback server takes no mmproj file without a model-specific chat handler
            binary = tools.require("llama-server", f"serving {target.name} with its vision side {vision.name}")
            return [str(binary), "--model", str(target), "--mmproj", str(vision), "--host", host, "--port", str(port),
                    "--ctx-size", ctx, "--parallel", "1", "--jinja", "--log-verbosity", "4"]
        if server is not None:
            return [str(server.path), "--model", str(target), "--host", host, "--port", str(port), "--ctx-size", ctx,
                    "--parallel", "1", "--jinja", "--log-verbosity", "4"]
        argv = [python, "-m", PYTHON_SERVER, "--model", str(target), "--host", host, "--port", str(port),
                "--n_ctx", ctx]
        if gguf_chat_template(target):
            argv += ["--chat_format", "chat_template.default"]
        return argv

    def health_path_for(self, argv: list[str]) -> str:
        return "/v1/models" if _is_python_server(argv) else self.health_path

    def own_decode_rate(self, event: dict[str, Any]) -> float | None:
        """llama-server's last event carries ``timings`` (its own ``predicted_per_second``)."""
        t = event.get("timings") or {}
        rate, n = t.get("predicted_per_second"), t.get("predicted_n")
        return float(rate) if isinstance(rate, (int, float)) and rate > 0 and isinstance(n, int) and n > 1 else None

    def log_facts(self, log_text: str) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        first = log_text.split("\n", 1)[0]
        python_server = _is_python_server(first.split())
        if python_server:
            facts["server"] = FALLBACK
        elif m := re.search(r"build (\d+) \(([0-9a-f]+)\)", log_text):
            facts["server"] = f"llama-server b{m.group(1)} ({m.group(2)})"
        if m := re.search(r"file type\s*=\s*(.+)", log_text):
            facts["file_type"] = m.group(1).strip()
        if m := re.search(r"load_tensors:\s+(AMX|CPU_REPACK) model buffer size", log_text):
            facts["weights_repacked_for"] = m.group(1)  # a CPU kernel path worth knowing when the server crashes
        if m := re.search(r"Using fallback chat format: (\S+)", log_text):
            facts["chat_format"] = f"{m.group(1)} (fallback: the GGUF has no chat template)"
        elif "Available chat formats from metadata: chat_template.default" in log_text:
            facts["chat_format"] = "the GGUF's chat template"
        elif not python_server and "chat template, example_format" in log_text:
            has = re.search(r"kv\s+\d+:\s+tokenizer\.chat_template\s", log_text)
            facts["chat_format"] = "the GGUF's chat template" if has else \
                "llama.cpp's default template (the GGUF has no chat template)"
        return facts


SERVER = LlamaCppServer()
