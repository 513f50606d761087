"""GGUF files in llama.cpp's OpenAI-compatible server (``python -m llama_cpp.server``).

Tested with llama-cpp-python[server] 0.3.36 (its vendored llama.cpp) and gguf 0.19.0, on CPU. One server per
``.gguf`` file: an artifact folder holding several quantization types is smoke-tested file by file.

The chat request uses the chat template stored in the GGUF (``--chat_format chat_template.default``), the one
llama.cpp's own tooling reads, rather than a format guessed from the template's text; without one the server
falls back to llama-2's format, which the smoke result notes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from quantkit.errors import UsageError
from quantkit.serve.base import Engine, ServeOptions


def gguf_chat_template(path: Path) -> str | None:
    """The ``tokenizer.chat_template`` a GGUF file carries (None if it has none or cannot be read)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
        return None if field is None else bytes(field.parts[field.data[0]]).decode()
    except Exception:  # an unreadable file: the server reports it properly when it tries to load it
        return None


class LlamaCppEngine(Engine):
    name = "llama.cpp"
    dist = "llama_cpp_python"
    module = "llama_cpp"
    health_path = "/v1/models"  # llama_cpp.server has no /health; it binds its port only once the model is loaded

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
        return True  # the GGUF's template, else llama.cpp's llama-2 fallback (noted in the run's facts)

    def command(self, target: Path, python: str, host: str, port: int, opts: ServeOptions) -> list[str]:
        argv = [python, "-m", "llama_cpp.server", "--model", str(target), "--host", host, "--port", str(port),
                "--n_ctx", str(opts.max_model_len or 2048)]
        if gguf_chat_template(target):
            argv += ["--chat_format", "chat_template.default"]
        return argv

    def log_facts(self, log_text: str) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        if m := re.search(r"file type\s*=\s*(.+)", log_text):
            facts["file_type"] = m.group(1).strip()
        if m := re.search(r"load_tensors:\s+(AMX|CPU_REPACK) model buffer size", log_text):
            facts["weights_repacked_for"] = m.group(1)  # a CPU kernel path worth knowing when the server crashes
        if m := re.search(r"Using fallback chat format: (\S+)", log_text):
            facts["chat_format"] = f"{m.group(1)} (fallback: the GGUF has no chat template)"
        elif "Available chat formats from metadata: chat_template.default" in log_text:
            facts["chat_format"] = "the GGUF's chat template"
        return facts


ENGINE = LlamaCppEngine()
