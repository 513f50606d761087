"""The transformers engine: plain and compressed-tensors checkpoints on CPU or GPU, fed token ids.

Tested with transformers 5.17.0, torch 2.13.0 (CPU) and compressed-tensors 0.19.0.

A compressed-tensors checkpoint (int4 packed, FP8, INT8 W8A8) is loaded through transformers' own compressed-tensors
quantizer, whose weights quantkit decompresses at load (what its hook would do on the first forward pass, so scoring
times only scoring) keeping each module's quantization scheme, so activation quantization is simulated as the
checkpoint asks. On CPU the model runs in float32 (bfloat16 weights upcast exactly; CPU bfloat16 matmuls are slow
and less precise); on a GPU it runs in the checkpoint's own dtype, as a serving engine would.

A mixture-of-experts checkpoint with asymmetric int4 or FP4 experts, which transformers 5.17 cannot reload, is
scored through a dense copy (:mod:`.dense_copy`), said in the engine's info (an FP4 W4A4 one then runs weight-only).

A vision-language checkpoint (a family of :mod:`quantkit.architectures` with a vision side) loads as
``AutoModelForImageTextToText``, the class it names, and is scored on text: its language model's log-probabilities.

An FP4 W4A4 checkpoint runs with its activations quantized to FP4 and back by compressed-tensors' forward wrapper:
emulated W4A4 numerics (:mod:`quantkit.engines.numerics`), said in the engine's info; ``numerics="weight-only"`` drops
the activations' scheme from every module first, which leaves them in 16/32 bits as Hopper's Marlin FP4 runs them.
compressed-tensors 0.19 decompresses FP4 weights into bfloat16 whatever the model's dtype, so on CPU the weights are
decompressed at load and cast to float32 with the rest (the same order as its first-forward hook: scales first).

Windows go through the model in batches of equal-length consecutive windows (no padding: every window attends to
its own tokens only), as many as a share of a GPU's free memory holds (one on a CPU: :func:`auto_batch`;
or ``EngineOptions.batch``), under ``torch.inference_mode``. Only the positions that predict scored tokens go
through ``lm_head``; their log-softmax is taken in float32 on the device, and :meth:`TransformersEngine.batches`
hands those rows over where they are (evaluation compares them there); :meth:`TransformersEngine.logits` copies
them to the host per window, for callers that want numpy.

ModelOpt exports (``hf_quant_config.json``) are refused: transformers ignores that file and would load the
quantized tensors as if they were plain weights, giving numbers that look valid and are not.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantkit.architectures import vision_language
from quantkit.checkpoint import read_config
from quantkit.devices import resolve_device
from quantkit.engines import numerics
from quantkit.engines.logits import EngineOptions, LogProbs, Rows, Window, check_compatible
from quantkit.engines.transformers import dense_copy
from quantkit.errors import BackendError, UsageError
from quantkit.formats.kinds import Kind
from quantkit.formats.names import TRANSFORMERS, KindName
from quantkit.versions import require

if TYPE_CHECKING:
    import torch

MAX_BATCH = 64  # windows per forward pass on a GPU at most
MEMORY_SHARE = 0.4  # of a GPU's free memory at load one batch may use


class TransformersEngine:
    """A causal LM loaded with ``AutoModelForCausalLM`` (or a vision-language model with its own class); one forward
    pass per batch of windows."""

    name = TRANSFORMERS

    def __init__(self, path: Path, options: EngineOptions) -> None:
        torch = require("torch", "eval", "evaluating with transformers")
        transformers = require("transformers", "eval", "evaluating with transformers")
        check_compatible(self.name, path)  # a ModelOpt export would load silently wrong
        self.path = path
        self._dense: Path | None = None
        if dense_copy.needed(path):
            self._dense = dense_copy.write(path, Path(tempfile.mkdtemp(prefix="quantkit-dense-")))
        self.device = resolve_device(options.device)
        self.dtype = torch.float32 if self.device == "cpu" else "auto"
        hf_logging = transformers.utils.logging
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # quantkit draws its own progress; transformers' would interleave
        auto = transformers.AutoModelForImageTextToText if vision_language(read_config(path)) else \
            transformers.AutoModelForCausalLM
        try:
            self.model = auto.from_pretrained(
                str(self._dense or path), dtype=self.dtype, device_map=None if self.device == "cpu" else self.device,
                trust_remote_code=False)
        except Exception as e:  # transformers raises many types for unreadable or unsupported checkpoints
            raise BackendError(f"transformers could not load {path}: {type(e).__name__}: {_first_line(e)}",
                               hint="check the checkpoint with `quantkit inspect`; legacy AutoAWQ/GPTQ layouts "
                                    "need their kernels installed, or use --engine vllm") from None
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self.model.eval()
        if self.dtype is torch.float32:
            all_float32(self.model)
        # What the first forward pass would do, done at load: scoring then times scoring alone, and the weights are
        # decompressed in the same order on every device (scales cast first on a CPU).
        if decompress(self.model) and self.dtype is torch.float32:
            all_float32(self.model)
        self.numerics = None
        if found := numerics.w4a4(path):
            weight_only = options.numerics == numerics.ASK_WEIGHT_ONLY
            if weight_only:
                keep_activations(self.model)
            self.numerics = numerics.DENSE_COPY if self._dense else \
                numerics.WEIGHT_ONLY if weight_only else numerics.EMULATED
            self.numerics_line = numerics.line(found, self.numerics, f"transformers on {self.device}")
        self._torch = torch
        self.batch = options.batch or auto_batch(self.model, self.device, options.ctx)
        self._versions = {"transformers": transformers.__version__, "torch": torch.__version__}

    def info(self) -> dict[str, Any]:
        dtype = self.dtype if isinstance(self.dtype, str) else str(self.dtype).removeprefix("torch.")
        if dtype == "auto":
            dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return {"engine": self.name, "version": self._versions["transformers"], "torch": self._versions["torch"],
                "device": self.device, "dtype": dtype, "model": str(self.path), "batch": self.batch,
                **({"numerics": self.numerics, "numerics_line": self.numerics_line} if self.numerics else {}),
                **({"loaded": "a dense copy decompressed by compressed-tensors (transformers 5.17 cannot reload "
                              "asymmetric int4 or FP4 compressed experts)"} if self._dense else {})}

    def batches(self, windows: Sequence[Window]) -> Iterator[Rows]:
        """Log-probabilities of each batch's scored rows, float32 on the model's device."""
        torch = self._torch
        for group in batches_of(windows, self.batch):
            ids = torch.tensor([w.tokens for w in group], dtype=torch.long, device=self.device)
            # Only the rows that predict scored tokens go through lm_head: the last n_scored + 1 positions of the
            # window with the most, of which the very last predicts past the window and is dropped.
            keep = max(w.n_scored for w in group) + 1
            with torch.inference_mode():
                logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
                if all(w.n_scored == keep - 1 for w in group):
                    lp = log_probs(logits[:, :-1]).flatten(0, 1)
                else:
                    lp = torch.cat([log_probs(logits[i, keep - 1 - w.n_scored:-1]) for i, w in enumerate(group)])
                del logits
            yield Rows(list(group), dense=lp)

    def logits(self, windows: Sequence[Window]) -> Iterator[LogProbs]:
        for rows in self.batches(windows):
            start = 0
            for w in rows.windows:
                assert rows.dense is not None
                yield LogProbs(dense=rows.dense[start:start + w.n_scored].cpu().numpy())
                start += w.n_scored

    def close(self) -> None:
        del self.model
        gc.collect()
        if self._dense is not None:
            shutil.rmtree(self._dense, ignore_errors=True)
        if self.device.startswith("cuda"):
            self._torch.cuda.empty_cache()


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the vocabulary; in place where the logits already are float32, since a second
    [rows, vocab] tensor on the host costs more in fresh pages than the log-softmax itself (a 2048-token window of
    a 49k vocabulary: 0.05 s to compute, up to 0.8 s to fault in 400 MB on the 2-core CPU)."""
    import torch

    if logits.dtype == torch.float32:
        return torch.log_softmax(logits, dim=-1, out=logits)
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def batches_of(windows: Sequence[Window], size: int) -> Iterator[list[Window]]:
    """Consecutive windows of one length, ``size`` at most per batch (the protocol's windows all have ``ctx`` tokens
    but the last, so batches stay full without padding)."""
    group: list[Window] = []
    for w in windows:
        if group and (len(group) == size or len(w.tokens) != len(group[0].tokens)):
            yield group
            group = []
        group.append(w)
    if group:
        yield group


def auto_batch(model: Any, device: str, ctx: int) -> int:
    """Windows of ``ctx`` tokens per forward pass. On a GPU, as many as a share of its free memory holds now (the
    model loaded): per token, the kept logits in the model's dtype, their float32 log-softmax and the comparison's
    float32 rows, and the layer activations. On a CPU one: batching was slower there (SmolLM2-135M on 2 cores: two
    windows of 2,048 per pass 29-32 s against 19-20 s one at a time; eight of 256, 9-10 s against 7-8 s)."""
    if not device.startswith("cuda"):
        return 1
    import torch

    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    vocab = int(getattr(cfg, "vocab_size", 0) or 32000)
    hidden = int(getattr(cfg, "hidden_size", 0) or 4096)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    width = next(model.parameters()).element_size()
    per_window = ctx * (vocab * (width + 4 + 8) + (8 * hidden + 4 * inter) * width)
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return max(1, min(MAX_BATCH, int(free * MEMORY_SHARE) // per_window))


def refuse(path: Path, kind: Kind) -> None:
    """What transformers cannot score at all (:func:`quantkit.engines.logits.check_compatible` asks, before any
    load): an MoE layout it cannot reload, and ModelOpt exports it would load silently wrong."""
    if why := dense_copy.refusal(path):
        raise UsageError(why, hint="evaluate it with --engine vllm (on a GPU)")
    if kind.name == KindName.MODELOPT:
        raise UsageError(f"{path} is a ModelOpt export (hf_quant_config.json): transformers ignores that file and "
                         "would load the quantized weights as plain ones, so its numbers would be wrong without any "
                         "error", hint="evaluate it with --engine vllm (on a GPU), or leave --engine auto")


def all_float32(model: Any) -> None:
    """Cast the parameters and buffers that loaded in bfloat16 or float16 to float32 (exactly).

    transformers 5.17 loading a compressed-tensors Qwen2.5-VL with ``dtype=float32`` leaves its body in bfloat16
    and its ``lm_head`` in float32, and the first matmul between them fails. Packed integer and FP8 weights are
    left as they are: compressed-tensors decompresses them into the model's dtype itself."""
    import torch

    half = (torch.bfloat16, torch.float16)
    for t in [*model.parameters(), *model.buffers()]:
        if t.dtype in half:
            t.data = t.data.float()


def decompress(model: Any) -> bool:
    """Decompress a compressed-tensors model now (what its first forward would do), so what it decompresses into
    can be cast before use; False when there is nothing left to decompress."""
    quantizer = getattr(model, "hf_quantizer", None)
    compressor = getattr(quantizer, "compressor", None)
    if compressor is None or not hasattr(model, "ct_decompress_hook"):
        return False
    compressor.decompress_model(model=model)
    return True


def keep_activations(model: Any) -> None:
    """Drop the input-activation scheme of every quantized module, so compressed-tensors' forward wrapper leaves
    the activations unquantized (weight-only numerics) and still dequantizes the weights."""
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and scheme.input_activations is not None:
            module.quantization_scheme = scheme.model_copy(update={"input_activations": None})


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def load(path: Path, options: EngineOptions) -> TransformersEngine:
    return TransformersEngine(path, options)
