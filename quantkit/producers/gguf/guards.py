"""Checkpoints llama.cpp's converter takes but converts wrong: refused before any work, each one measured.

llama.cpp's ``convert_hf_to_gguf.py`` (b11312) converts some configurations without a word, and the file then
computes other logits than transformers. Which ones, per architecture, with what was measured for each, are rows of
the architecture table (``llama_cpp_refuses`` of :data:`quantkit.architectures.TABLE`: Qwen3-MoE's
``norm_topk_prob``, Gemma 3's ``layer_types``, DeepSeek-V2/V3's attention bias, rope layout, expert scoring and
YaRN scale); ``tests/test_gguf_moe.py`` and ``tests/test_gguf.py`` repeat the cases. A vision-language model's
quirks are its language model's: they are asked of its ``text_config``.
"""

from __future__ import annotations

from typing import Any

from quantkit import architectures
from quantkit.errors import SourceModelError

_HINT = "serve this checkpoint with an engine that follows transformers (vLLM), or choose another method"


def refuse(config: dict[str, Any]) -> None:
    """Raise SourceModelError (exit 2, one line) for a configuration llama.cpp would compute differently."""
    row = architectures.get(config)
    text = architectures.text_config(config)
    for quirk in row.llama_cpp_refuses if row else ():
        if quirk.wrong(text):
            raise SourceModelError(f"{row.name}: {quirk.reason(text)}", hint=quirk.hint or _HINT)
