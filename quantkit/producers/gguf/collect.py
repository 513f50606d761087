"""Computing an importance matrix in transformers, on exactly quantkit's calibration token ids.

For every weight matrix of the transformer blocks, the sum over tokens of the square of each input activation
(one value per input column) and the number of tokens summed: what ``llama-imatrix`` collects from llama.cpp's
graph, collected here with forward pre-hooks (why quantkit computes it at all: :mod:`.imatrix`). Three kinds of
module are hooked, each under the GGUF name gguf-py's own ``TensorNameMap`` gives it (from the converter's
sdist, through :meth:`.convert.Plan.gguf_name`), and only where the converter's plan of the file (its tensor
names and shapes, :func:`.convert.plan`) holds a tensor of that name and shape:

* ``nn.Linear`` (attention, dense MLPs, shared experts): the input of every token;
* the MoE router (``ffn_gate_inp``; in transformers 5.17 a module of its own that multiplies its input by its
  ``weight``): every token, as llama-imatrix records it, although llama.cpp never quantizes routers;
* the experts module (``mlp.experts``; fused 3-D ``gate_up_proj`` (experts, 2 x ffn, hidden) and ``down_proj``
  (experts, hidden, ffn), called with the router's ``top_k_index``, in every supported family): for each
  expert, only the tokens the model's own router sent to it, as llama.cpp's ``MUL_MAT_ID`` does. llama.cpp stores a
  stacked expert tensor's entry as one row of sums and one count per expert (``in_sum2`` [experts x columns],
  ``counts`` [experts]), and its quantizer divides each expert's row by that expert's count (an expert that got
  no token is quantized with even weights). ``ffn_gate_exps`` and ``ffn_up_exps`` see the expert's input;
  ``ffn_down_exps`` sees ``act(gate) * up``, which exists only inside the experts' forward, whatever
  implementation transformers dispatches to (eager, grouped_mm, batched_mm), so the hook computes it again from
  the module's own weights and gating (``_apply_gate``): the experts' gate/up products are done twice.

Left out, as by default in llama-imatrix: ``output.weight`` and the embeddings (a lookup, not a product). Also
left out: MLA's ``attn_k_b``/``attn_v_b`` (DeepSeek-V3), which llama.cpp's absorbed attention multiplies with the
per-head query and the attention-weighted latent; transformers' attention does not form the latter. They are
quantized without importance weights, and the types llama.cpp will not make without them are refused
(:func:`refuse_uncovered`). A block matrix of the file that none of the three kinds of module holds is refused
before any forward pass: the matrix would silently lack it.

Why this stays rather than ``llama-imatrix`` on the converted F16 file, measured on SmolLM2-135M
(``bench/gguf_imatrix.py``, README): the same quality of Q4_K_M, on exactly the recorded calibration token ids
(see :mod:`.imatrix`), on any device torch has.

``tests/test_gguf_imatrix.py`` and ``tests/test_gguf_imatrix_moe.py`` run ``llama-imatrix`` and this module on the
same tokens and compare every entry: on both reference models (dense, and MoE with a trained router) the same token
counts, per expert too, and every column within 0.2%.

Tested with transformers 5.17.0, torch 2.13 and llama.cpp b11312 (llama-cpp-python 0.3.36).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from quantkit.checkpoint import read_config
from quantkit.devices import resolve_device
from quantkit.errors import BackendError, SourceModelError, UsageError
from quantkit.producers.gguf.imatrix import COMPUTE_FLAG, FILE_FLAG, Entry, Imatrix
from quantkit.progress import Reporter

BATCH_TOKENS = 8192  # tokens per forward pass (samples of equal length are batched up to this)
ROUTER = ".ffn_gate_inp."  # llama.cpp's router tensors


MLA_ABSORBED = (".attn_k_b.", ".attn_v_b.")  # llama.cpp's per-head MLA matrices, which transformers does not form


def covered(plan: Any) -> dict[str, tuple[int, ...]]:
    """GGUF name -> logical shape of every block matrix a computed matrix covers: the 2-D matrices and the stacked
    experts of the transformer blocks in the converter's plan, except MLA's ``attn_k_b``/``attn_v_b``."""
    return {t.name: t.shape for t in plan.tensors if t.name.startswith("blk.") and len(t.shape) >= 2
            and not any(m in t.name for m in MLA_ABSORBED)}


def is_mla(plan: Any) -> bool:
    """Whether the file has MLA's absorbed matrices (DeepSeek-V2/V3), which a computed matrix leaves out."""
    return any(m in t.name for t in plan.tensors for m in MLA_ABSORBED)


def refuse_uncovered(plan: Any, wanted: list[Any]) -> None:
    """Refuse, before any work, the types llama.cpp makes only with importance weights for every tensor it gives
    a very-low-bit type, when the computed matrix cannot cover some of them (MLA's attn_k_b/attn_v_b)."""
    needy = [t.name for t in wanted if t.needs_imatrix]
    if is_mla(plan) and needy:
        raise UsageError(f"{', '.join(needy)} cannot be made for {plan.architecture} with an importance matrix "
                         "computed by quantkit: llama.cpp needs importance weights for every tensor these types "
                         "quantize at very low bits, MLA's attn_k_b and attn_v_b among them, and quantkit does not "
                         "compute those two "
                         "(llama.cpp multiplies them with its absorbed attention's per-head query and attention-"
                         "weighted latent)",
                         hint=f"pass a matrix made by llama-imatrix with {FILE_FLAG} FILE instead of {COMPUTE_FLAG}, "
                              "or choose a type that does not need one (Q2_K, Q3_K_M, IQ3_M, IQ4_XS...)")


def compute(model_dir: Path, plan: Any, samples: list[list[int]], *, device: str,
            reporter: Reporter) -> tuple[Imatrix, dict[str, Any]]:
    """Sum the squared inputs of every covered block matrix of ``plan`` (:func:`.convert.plan`) over
    ``samples`` (token ids) in transformers.

    Returns the matrix and how it was computed (device, dtype, versions) for the manifest. On CPU the model runs
    in float32 (the checkpoint's bf16/f16 weights upcast exactly, like llama.cpp's F32 activations); on a GPU in
    the checkpoint's own dtype. Sums are accumulated in float64.
    """
    from quantkit.versions import require

    torch = require("torch", "gguf", "computing an importance matrix")
    transformers = require("transformers", "gguf", "computing an importance matrix")
    dev = resolve_device(device)
    model = _load(transformers, torch, model_dir, dev, reporter)
    wanted = covered(plan)
    sums = _Sums()
    handles = [h for name, module in model.named_modules()
               for h in _register(name, module, plan, wanted, sums, torch)]
    missing = sorted(set(wanted) - sums.hooked)
    try:
        if missing:
            shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
            raise SourceModelError(f"the importance matrix cannot cover {len(missing)} block matrices ({shown}): "
                                   "transformers' model holds them in no module quantkit reads (an nn.Linear, a "
                                   "router, or fused 3-D experts of the checkpoint's shape)",
                                   hint=f"pass an importance matrix made by llama-imatrix with {FILE_FLAG} FILE")
        total = sum(len(s) for s in samples)
        with reporter.bar(f"Importance matrix on {dev} ({len(samples)} samples)", total=total, unit="tok") as bar, \
                torch.inference_mode():
            for batch in _batches(samples):
                ids = torch.tensor(batch, dtype=torch.long, device=dev)
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
                bar.advance(ids.numel())
    finally:
        for h in handles:
            h.remove()
    how = {"engine": "transformers", "transformers": transformers.__version__, "torch": torch.__version__,
           "device": dev, "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    del model
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    return Imatrix(sums.entries()), how


def _load(transformers: Any, torch: Any, model_dir: Path, dev: str, reporter: Reporter) -> Any:
    """The checkpoint in transformers, in eval mode: float32 on CPU, its own dtype on a GPU. A vision-language
    model loads whole (``AutoModelForImageTextToText``; its language model is ``model.language_model``, named in
    the file as upstream names it, :meth:`.convert.Plan.gguf_name`) and runs on text tokens alone."""
    dtype = torch.float32 if dev == "cpu" else "auto"
    auto = transformers.AutoModelForImageTextToText if read_config(model_dir).get("vision_config") else \
        transformers.AutoModelForCausalLM
    hf_logging = transformers.utils.logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # quantkit draws its own progress; transformers' would interleave
    with reporter.step("imatrix_load", f"Loading {model_dir.name} in transformers on {dev}"):
        try:
            model = auto.from_pretrained(
                str(model_dir), dtype=dtype, device_map=None if dev == "cpu" else dev, trust_remote_code=False)
        except Exception as e:  # transformers raises many types for checkpoints it cannot load
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            raise BackendError(f"transformers could not load {model_dir} to compute the importance matrix: "
                               f"{type(e).__name__}: {first}",
                               hint=f"pass an importance matrix made by llama-imatrix with {FILE_FLAG} FILE") from None
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    return model.eval()


class _Sums:
    """Running sums of squared inputs (float64, one row per matrix: one, or one per expert) and token counts, per
    GGUF tensor name; ``hooked`` is every name a hook was registered for."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.counts: dict[str, Any] = {}
        self.hooked: set[str] = set()

    def add(self, name: str, part: Any, count: Any) -> None:
        """Add ``part`` [n_mat, cols] and ``count`` [n_mat]; out of place, so one tensor may be added twice."""
        self.sums[name] = part if name not in self.sums else self.sums[name] + part
        self.counts[name] = count if name not in self.counts else self.counts[name] + count

    def entries(self) -> dict[str, Entry]:
        import numpy as np

        return {name: Entry(self.sums[name].float().cpu().numpy(),
                            self.counts[name].cpu().numpy().astype(np.float32))
                for name in sorted(self.sums)}


def _register(module_name: str, module: Any, plan: Any, wanted: dict[str, tuple[int, ...]],
              sums: _Sums, torch: Any) -> list[Any]:
    """Hook ``module`` if it holds covered block matrices (one hook for the experts' three stacked tensors);
    returns the handles."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter):
        names = [plan.gguf_name(f"{module_name}.{proj}") for proj in ("gate_proj", "up_proj", "down_proj")]
        if not all(n in wanted for n in names):
            return []
        gate, up, dn = names
        n_exp, ffn, hidden = wanted[gate]
        if tuple(gate_up.shape) != (n_exp, 2 * ffn, hidden) or tuple(down.shape) != wanted[dn]:
            return []
        sums.hooked.update(names)
        return [module.register_forward_pre_hook(_experts_hook(gate, up, dn, sums, torch), with_kwargs=True)]
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
        return []
    name = plan.gguf_name(module_name)
    if name not in wanted:
        return []
    if not (isinstance(module, torch.nn.Linear) or ROUTER in name) or weight.shape[-1] != wanted[name][-1]:
        return []
    sums.hooked.add(name)
    return [module.register_forward_pre_hook(_dense_hook(name, sums, torch))]


def _dense_hook(name: str, sums: _Sums, torch: Any) -> Callable[..., None]:
    """Every token's input to one matrix."""
    def hook(module: Any, args: tuple[Any, ...]) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        sums.add(name, (x * x).sum(dim=0, dtype=torch.float64)[None],
                 torch.tensor([x.shape[0]], dtype=torch.long, device=x.device))
    return hook


def _experts_hook(gate: str, up: str, down: str, sums: _Sums, torch: Any) -> Callable[..., None]:
    """Per expert, the inputs of the tokens the router chose it for: the hidden states for gate and up, and
    ``act(gate) * up`` for down, recomputed with the module's own weights and gating."""
    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0].detach()
        x = x.reshape(-1, x.shape[-1])
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        chosen = index.reshape(x.shape[0], -1)
        n_exp = module.gate_up_proj.shape[0]
        s_in = torch.zeros(n_exp, x.shape[-1], dtype=torch.float64, device=x.device)
        s_mid = torch.zeros(n_exp, module.down_proj.shape[-1], dtype=torch.float64, device=x.device)
        count = torch.zeros(n_exp, dtype=torch.long, device=x.device)
        for e in torch.unique(chosen).tolist():
            if not 0 <= e < n_exp:  # expert-parallel sentinels: not an expert of this module
                continue
            rows = (chosen == e).nonzero()[:, 0]  # a token once per slot that chose e, as llama.cpp counts
            xe = x[rows]
            mid = module._apply_gate(torch.nn.functional.linear(xe, module.gate_up_proj[e]))
            s_in[e] = (xe.float() ** 2).sum(dim=0, dtype=torch.float64)
            s_mid[e] = (mid.float() ** 2).sum(dim=0, dtype=torch.float64)
            count[e] = rows.numel()
        sums.add(gate, s_in, count)
        sums.add(up, s_in, count)
        sums.add(down, s_mid, count)
    return hook


def _batches(samples: list[list[int]]) -> Iterator[list[list[int]]]:
    """Samples of equal length, grouped into batches of at most ``BATCH_TOKENS`` tokens (no padding needed)."""
    by_len: dict[int, list[list[int]]] = {}
    for s in samples:
        by_len.setdefault(len(s), []).append(s)
    for n, group in by_len.items():
        per = max(1, BATCH_TOKENS // n)
        for i in range(0, len(group), per):
            yield group[i:i + per]
