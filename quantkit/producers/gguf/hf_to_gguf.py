"""llama.cpp's ``convert_hf_to_gguf.py`` as a library, with quantkit's answer for a locally trained tokenizer.

Run by :mod:`.upstream` as a script, never imported by quantkit: with the venv's Python, ``-P`` (so this folder,
which holds a ``types.py``, does not shadow the standard library) and ``PYTHONPATH`` = the converter's folder and
its own ``gguf-py``, so converter and gguf library are one llama.cpp commit. It imports nothing of quantkit.

    python -P hf_to_gguf.py --result R.json [--pre NAME] [--plan] -- CONVERTER-ARGS...

Two modes:

* convert (default): upstream's ``main()`` with ``CONVERTER-ARGS`` (``MODEL --outtype f16 --outfile F``);
* ``--plan``: everything the conversion does up to writing (hyperparameters, vocabulary, every tensor's GGUF
  name, shape and type, computed lazily: no weight is read), nothing written. quantkit checks a checkpoint with it
  before any work, and names importance-matrix entries from it.

Either mode with ``--mmproj`` among ``CONVERTER-ARGS`` is about a vision-language model's vision side, the
``mmproj`` file upstream writes for ``llama-server --mmproj``.

llama.cpp recognises a BPE pre-tokenizer by hashing the token ids of a fixed text, so a tokenizer trained locally
with a standard splitter (quantkit's reference model) is refused. ``--pre NAME`` is the pre-tokenizer quantkit
matched from ``tokenizer.json``'s own regex; it is used only when upstream's check raised, and the result says so
(``pre_from``). A weight-only NVFP4 checkpoint's repacked tensors are tagged to keep 8-bit activations
(:func:`_keep_weight_only_activations`; ``weight_only_from``). A SentencePiece-style vocabulary that only a
tokenizer.json holds gets scores from its merge ranks (:func:`_score_by_merge_rank`; ``scores_from``). Any failure
is written to the result as one line (its kind, the architecture), and the exit status is 3; the converter's own log
goes to stderr. A bare ``assert`` of upstream's, which says nothing, is written as its condition with the value of
each side where it compares (:func:`_failed_assert`). A failure while reading the tokenizer is its own kind (``tokenizer``): the checkpoint's tokenizer
files, not the converter, are what to fix.
"""

from __future__ import annotations

import argparse
import ast
import json
import linecache
import re
import sys
import textwrap
import traceback
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

UNKNOWN_PRE = "BPE pre-tokenizer was not recognized"
# llama.cpp applies a Phi-3 tokenizer fix-up to models whose general.name contains "phi3", looking these tokens up
# (src/llama-vocab.cpp); the plan says which the vocabulary has.
PHI3_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")
FAILED = 3

_seen: dict[str, Any] = {"pre_tokenizer": None, "pre_from": None, "scores_from": None, "vision_names": [],
                         "embedding_rows_from": None, "weight_only_from": None}
MMPROJ = "--mmproj"


def _answer_pre(fallback: str | None) -> None:
    """Wrap upstream's get_vocab_base_pre: its answer when it has one, else quantkit's (when given)."""
    from conversion.base import TextModel

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        try:
            res = original(self, tokenizer)
        except NotImplementedError as e:
            if fallback is None or UNKNOWN_PRE not in str(e):
                raise
            _seen.update(pre_tokenizer=fallback, pre_from="quantkit")
            return fallback
        _seen.update(pre_tokenizer=res, pre_from="upstream")
        return res

    TextModel.get_vocab_base_pre = get_vocab_base_pre  # type: ignore[method-assign]


def _score_by_merge_rank() -> None:
    """Score a SentencePiece-style vocabulary read from tokenizer.json alone by its BPE merge ranks.

    A Llama-2-style tokenizer saved by transformers 5 has no tokenizer.model, only its tokenizer.json form (BPE
    with byte fallback over "▁"-joined text). Upstream reads it with ``gguf.LlamaHfVocab``, which scores every
    token -1000, and llama.cpp's SentencePiece tokenizer, which merges the best-scored pair first, then splits
    text differently from transformers (measured: tests/test_gguf.py::test_sentencepiece_style_tokenizer_json).
    The score a merge rank gives (higher merges first) is the order SentencePiece's own scores encode; tokens no
    merge makes come last, single characters at 0.
    """
    import gguf

    def get_token_score(self: Any, token_id: int) -> float:
        if not hasattr(self, "_quantkit_rank"):
            model = json.loads(Path(self.fname_tokenizer).read_text(encoding="utf-8"))["model"]
            merges = model.get("merges") or []
            rank: dict[str, int] = {}
            for r, m in enumerate(merges):
                a, b = m if isinstance(m, list) else m.split(" ", 1)
                rank.setdefault(a + b, r)
            self._quantkit_rank, self._quantkit_last = rank, -float(len(merges) + 1)
            _seen["scores_from"] = "quantkit"
        tok = self.tokenizer.convert_ids_to_tokens(token_id)
        if tok in self._quantkit_rank:
            return -float(self._quantkit_rank[tok] + 1)
        return 0.0 if len(tok) == 1 else self._quantkit_last

    gguf.LlamaHfVocab.get_token_score = get_token_score  # type: ignore[method-assign]


def _keep_gemma3_rows() -> None:
    """Keep every embedding row of a Gemma 3 whose vocabulary is read from tokenizer.json.

    Upstream's Gemma 3 class cuts ``token_embd`` to the tokenizer's own tokens (``len(vocab) + len(added_tokens)``,
    the rows past them being unused in Google's checkpoints), but its tokenizer.json path (no ``tokenizer.model``,
    as transformers 5 saves a tokenizer) writes a vocabulary padded to ``vocab_size``, so llama.cpp refuses the
    file ("tensor 'token_embd.weight' has wrong shape; expected 256, 8256, got 256, 8199": tests/vlm_models.py's
    Gemma 3). Without ``tokenizer.model`` the rows stay as the checkpoint has them, one per token written
    (``embedding_rows_from``); with one, upstream's cut and its SentencePiece vocabulary agree and nothing changes.
    """
    from conversion.base import TextModel
    from conversion.gemma import Gemma3Model

    original = Gemma3Model.modify_tensors

    def modify_tensors(self: Any, data_torch: Any, name: str, bid: int | None) -> Any:
        if "embed_tokens.weight" in name and not (self.dir_model / "tokenizer.model").is_file():
            _seen["embedding_rows_from"] = "quantkit"
            return TextModel.modify_tensors(self, data_torch, name, bid)
        return original(self, data_torch, name, bid)

    Gemma3Model.modify_tensors = modify_tensors  # type: ignore[method-assign]


def _weight_only(quantization_config: dict[str, Any]) -> bool:
    """A compressed-tensors checkpoint whose every config group quantizes weights only (NVFP4A16, MXFP4A16)."""
    groups = [g for g in (quantization_config.get("config_groups") or {}).values() if isinstance(g, dict)]
    return (quantization_config.get("quant_method") == "compressed-tensors" and bool(groups)
            and all(not g.get("input_activations") for g in groups))


def _keep_weight_only_activations() -> None:
    """Tag the repacked tensors of a weight-only compressed-tensors NVFP4 checkpoint as taking no 4-bit activations.

    llama.cpp multiplies an NVFP4 (or MXFP4) matrix with FP4 activations on a Blackwell GPU unless the file's
    ``general.tensor_extra.prec_a4`` says no for it (``ggml_cuda_mmq_get_prec_src1`` in ggml-cuda/mmq.cu); upstream's
    converter says no only for ModelOpt's ``W4A16_NVFP4``. An NVFP4A16 checkpoint from llm-compressor (its config
    groups have no ``input_activations``) would then run there as W4A4, numerics it was not made or measured for.
    Each of its repacked tensors is tagged as upstream tags W4A16_NVFP4's (``weight_only_from`` in the result). CPUs
    and GPUs before Blackwell use 8-bit activations either way.
    """
    from conversion.base import ModelBase

    original = ModelBase._tag_prec_a4

    def _tag_prec_a4(self: Any, hf_name: str, gguf_name: str) -> None:
        original(self, hf_name, gguf_name)
        if gguf_name not in self._prec_a4 and _weight_only(self.hparams.get("quantization_config") or {}):
            self._prec_a4[gguf_name] = False
            _seen["weight_only_from"] = "quantkit"

    ModelBase._tag_prec_a4 = _tag_prec_a4  # type: ignore[method-assign]


def _hub_spelling(name: str, block_count: int) -> tuple[str, int, str] | None:
    """The spelling upstream's vision name map knows for a tensor it could not map, the blocks the map needs, and
    why (``vision_names``); None when quantkit knows no other spelling."""
    merger = re.match(r"visual\.merger\.mlp\.(\d+)\.", name)
    if merger and int(merger.group(1)) >= block_count:
        return name, int(merger.group(1)) + 1, "merger_index"
    return None


def _name_vision_tensors() -> None:
    """Name, after upstream's own map failed, the vision tensors of a checkpoint it cannot name (measured: the tiny
    checkpoints of tests/vlm_models.py): Qwen2-VL's patch merger ``visual.merger.mlp.0``/``mlp.2``, which upstream
    names through its per-block map, so a vision tower of fewer than three blocks has no name for ``mlp.2`` ("Can
    not map tensor 'visual.merger.mlp.2.bias'"). A CLIP or SigLIP tower spelled without its ``vision_model`` level
    (what transformers 5 saves for a model made from a config, never for one it loaded) is not renamed: vLLM
    cannot load that spelling either, and released checkpoints do not have it."""
    import gguf
    from conversion.base import MmprojModel

    original = MmprojModel.map_tensor_name

    def map_tensor_name(self: Any, name: str, try_suffixes: Any = (".weight", ".bias")) -> str:
        try:
            return original(self, name, try_suffixes)
        except ValueError:
            other = _hub_spelling(name, self.block_count)
            if other is None:
                raise
        spelled, blocks, why = other
        found = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, blocks).get_name(key=spelled,
                                                                                 try_suffixes=try_suffixes)
        if found is None:
            raise ValueError(f"Can not map tensor {name!r} (nor {spelled!r})")
        if why not in _seen["vision_names"]:
            _seen["vision_names"].append(why)
        return found

    MmprojModel.map_tensor_name = map_tensor_name  # type: ignore[method-assign]


def _architecture(model: Path) -> str | None:
    try:
        archs = json.loads((model / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    return archs[0] if archs else None


def _plan(model: Path, mmproj: bool) -> dict[str, Any]:
    """Build the model as upstream's main() does for a text model (or, ``mmproj``, the vision side), run it up to
    the writing, and describe it."""
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    with torch.inference_mode():
        hparams = ModelBase.load_hparams(model, False)
        arch = get_model_architecture(hparams, ModelType.MMPROJ if mmproj else ModelType.TEXT)
        try:
            cls = get_model_class(arch, mmproj=mmproj)
        except NotImplementedError:
            if not mmproj:
                raise
            raise NotImplementedError(f"it has no vision (mmproj) converter class for {arch}") from None
        m = cls(model, gguf.LlamaFileType.MOSTLY_F16, model / "plan.gguf", dry_run=True)
        m.prepare_tensors()
        m.prepare_metadata(vocab_only=False)
    infos = m.gguf_writer.tensors[0]
    kv = m.gguf_writer.kv_data[0]
    if mmproj:
        projector = kv.get(gguf.Keys.Clip.PROJECTOR_TYPE) or kv.get(gguf.Keys.ClipVision.PROJECTOR_TYPE)
        return {"gguf_arch": gguf.MODEL_ARCH_NAMES[m.model_arch], "model_class": cls.__name__,
                "block_count": m.block_count, "projector": projector.value if projector else None,
                "tensors": [[name, [int(d) for d in ti.shape], ti.dtype.name] for name, ti in infos.items()]}
    tokens = set(kv["tokenizer.ggml.tokens"].value) if "tokenizer.ggml.tokens" in kv else set()
    return {"gguf_arch": gguf.MODEL_ARCH_NAMES[m.model_arch], "model_class": cls.__name__,
            "block_count": m.block_count,
            "tensors": [[name, [int(d) for d in ti.shape], ti.dtype.name] for name, ti in infos.items()],
            "name_map": {key: name for key, (_, name) in m.tensor_map.mapping.items()},
            "tokenizer_model": kv["tokenizer.ggml.model"].value if "tokenizer.ggml.model" in kv else None,
            "phi3_tokens": all(t in tokens for t in PHI3_TOKENS)}


def _reading_vocabulary(e: BaseException) -> bool:
    """Whether an error came from reading the tokenizer: upstream reads it in ``set_vocab``, its ``_set_vocab_*``
    helpers and ``get_vocab_base`` (through transformers' AutoTokenizer or sentencepiece), each named for it."""
    return any("vocab" in frame.name for frame in traceback.extract_tb(e.__traceback__))


def _failed_assert(e: AssertionError) -> str:
    """A bare ``assert`` of upstream's as one line: its condition, where it is, and each side of a comparison as it
    was in the frame that failed (``max(tokenizer.vocab.values()) < vocab_size``: 8192 and 8192)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "a check of the converter failed"
    where = f"{'/'.join(Path(tb.tb_frame.f_code.co_filename).parts[-2:])}:{tb.tb_lineno}"
    node = _assert_at(tb)
    if node is None:
        return f"a check of the converter failed at {where}"
    values = _sides(node.test, tb.tb_frame)
    shown = f" ({', '.join(values)})" if values else ""
    return f"the converter's check `{ast.unparse(node.test)}` failed at {where}{shown}"


def _assert_at(tb: TracebackType) -> ast.Assert | None:
    """The ``assert`` statement a traceback's last frame stopped at, parsed from its source; None where it cannot be
    read or is no assert."""
    summary = traceback.extract_tb(tb, limit=1)[0]
    last = summary.end_lineno or tb.tb_lineno
    source = "".join(linecache.getline(summary.filename, n) for n in range(tb.tb_lineno, last + 1))
    try:
        node = ast.parse(textwrap.dedent(source)).body[0]
    except (SyntaxError, IndexError):
        return None
    return node if isinstance(node, ast.Assert) else None


def _sides(test: ast.expr, frame: FrameType) -> list[str]:
    """``EXPR is VALUE`` for each side of a comparison but constants, the converter's own expression evaluated again
    in the frame it failed in (an expression that does not evaluate again is left out)."""
    if not isinstance(test, ast.Compare):
        return []
    shown = []
    for side in [test.left, *test.comparators]:
        if isinstance(side, ast.Constant):
            continue
        try:
            value = eval(compile(ast.Expression(side), "<assert>", "eval"), frame.f_globals, frame.f_locals)
        except Exception:
            continue
        shown.append(f"{ast.unparse(side)} is {value!r}")
    return shown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--pre", default=None)
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    rest = [a for a in args.rest if a != "--"] if args.rest[:1] == ["--"] else args.rest
    model = Path(next(a for a in rest if not a.startswith("-")) if not args.plan else rest[0])
    mmproj = MMPROJ in rest
    result: dict[str, Any] = {"architecture": _architecture(model)}
    try:
        import convert_hf_to_gguf

        _answer_pre(args.pre)
        _score_by_merge_rank()
        _keep_weight_only_activations()
        if mmproj:
            _name_vision_tensors()
        else:
            _keep_gemma3_rows()
        if args.plan:
            import logging

            logging.basicConfig(level=logging.WARNING)
            result.update(_plan(model, mmproj))
        else:
            sys.argv = ["convert_hf_to_gguf.py", *rest]
            convert_hf_to_gguf.main()
    except SystemExit as e:  # upstream's main() exits 1 after logging why (an unsupported architecture...)
        if e.code not in (0, None):
            result["error"] = {"kind": "exit", "message": f"convert_hf_to_gguf.py exited with status {e.code}"}
    except NotImplementedError as e:
        kind = "pre_tokenizer" if UNKNOWN_PRE in str(e) else "not_implemented"
        result["error"] = {"kind": kind, "message": str(e).strip().splitlines()[0] if str(e).strip() else kind}
    except AssertionError as e:  # upstream's bare asserts say nothing: the condition that failed does
        traceback.print_exc(file=sys.stderr)
        kind = "tokenizer" if _reading_vocabulary(e) else "failed"
        said = " ".join(str(e).split())
        result["error"] = {"kind": kind, "message": (f"AssertionError: {said}" if said else _failed_assert(e))[:500]}
    except Exception as e:  # the converter raises many types for input it cannot take
        traceback.print_exc(file=sys.stderr)
        if _reading_vocabulary(e):  # the whole message: transformers' first line only says it listed the ways
            said = " ".join(str(e).split())
            result["error"] = {"kind": "tokenizer", "message": f"{type(e).__name__}: {said}"[:500]}
        else:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            result["error"] = {"kind": "failed", "message": f"{type(e).__name__}: {first}"[:400]}
    result.update(_seen)
    args.result.write_text(json.dumps(result))
    return FAILED if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
