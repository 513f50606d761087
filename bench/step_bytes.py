"""The bytes of weights one decode step reads, counted from a checkpoint's safetensors headers: the denominator of
the memory-bandwidth limit on decode speed (bench/serve_speed.py).

A dense model reads every weight once per step, except the input embedding table, of which it reads one row per
sequence (unless the table is tied to ``lm_head``). A mixture-of-experts model reads its attention, norms, routers,
shared experts and ``lm_head`` every step, but of its routed experts only those the step's tokens were sent to:

* at batch 1, exactly top-k of the E experts of each MoE layer;
* at batch B, the experts hit by any of the B tokens. Under uniform routing (each token picks k distinct experts)
  that is E x (1 - (1 - k/E)^B) per layer in expectation (Qwen3-30B-A3B's top-8 of 128 at batch 16: 82.4); at
  most min(E, B x k), when no two tokens share an expert. The limit uses the expectation (random weights route
  near-uniformly); :meth:`StepBytes.read` also gives the bound.

A routed-expert tensor is one under ``.experts.`` (``mlp.experts.7.down_proj.weight_packed``, or a fused
``mlp.experts.gate_up_proj``); a shared expert (``shared_expert.``, ``shared_experts.``) is read every step. Scales,
zero points and other per-expert side tensors count with their expert. KV-cache reads are left out (they only
lower the real bound). Needs quantkit's safetensors header reader, nothing else.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quantkit.source import safetensors_header  # noqa: E402

_EXPERT = re.compile(r"(?:^|\.)experts\.")  # routed experts; "shared_experts." is preceded by "_", not "."
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class StepBytes:
    """A checkpoint's weight bytes, split into what every decode step reads and the routed experts."""

    total: int  # every tensor in the weight files
    always: int  # read by every step whatever the batch (dense weights; the untied input embedding left out)
    experts: int  # all routed experts of all MoE layers (0 for a dense model)
    num_experts: int = 0  # routed experts per MoE layer
    top_k: int = 0  # experts per token

    @property
    def moe(self) -> bool:
        return self.num_experts > 1 and self.experts > 0

    def experts_hit(self, batch: int, bound: bool = False) -> float:
        """Experts per MoE layer one step reads at ``batch``: the expectation under uniform routing, or (``bound``)
        the most there can be, min(E, batch x k)."""
        if not self.moe:
            return 0.0
        e, k = self.num_experts, self.top_k
        if bound or batch == 1:
            return float(min(e, batch * k))
        return e * (1 - (1 - k / e) ** batch)

    def read(self, batch: int, bound: bool = False) -> float:
        """Bytes one decode step reads at ``batch`` (see :meth:`experts_hit` for ``bound``)."""
        if not self.moe:
            return float(self.always)
        return self.always + self.experts * self.experts_hit(batch, bound) / self.num_experts


def count(folder: Path) -> StepBytes:
    """Sum the tensors of every ``*.safetensors`` file in ``folder`` by what a decode step reads of them."""
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings")))
    num_experts = next((int(text[k]) for k in _EXPERT_KEYS if text.get(k)), 0)
    total = always = experts = 0
    for f in sorted(folder.glob("*.safetensors")):
        header, _ = safetensors_header(f)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            n = info["data_offsets"][1] - info["data_offsets"][0]
            total += n
            if num_experts > 1 and _EXPERT.search(name):
                experts += n
            elif tied or not name.endswith("embed_tokens.weight"):
                always += n
    return StepBytes(total, always, experts, num_experts if experts else 0,
                     int(text.get("num_experts_per_tok") or 0) if experts else 0)
