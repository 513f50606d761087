"""One Hugging Face checkpoint -> one GGUF file of a directly written type (F32, F16, BF16 or Q8_0), by llama.cpp.

The conversion is llama.cpp's own ``convert_hf_to_gguf.py`` (226 model classes, 97 pre-tokenizer hashes, kept
by the format's owner), from the llama-cpp-python sdist whose llama.cpp the tools are built from
(:func:`.tools.require_converter`), run as a subprocess with the venv's Python and that sdist's ``gguf-py``
through the small wrapper :mod:`.hf_to_gguf`. What quantkit adds:

* :func:`plan`: everything the converter does short of writing (no weight read), so a checkpoint it cannot
  take is refused before any work, naming the architecture and the converter's reason in one line; and the
  GGUF tensor names and shapes it will write, which importance matrices are named and checked against;
* a locally trained tokenizer: llama.cpp recognises a BPE pre-tokenizer only by the hash of a fixed text's token
  ids, so quantkit's reference model (its own BPE, trained with Llama 3's splitter) is refused upstream. Where
  :func:`.tokenizer.match` finds the splitter from ``tokenizer.json``'s own regex, the wrapper supplies that
  name, only after upstream's check failed; the manifest says which of the two named it (``pre_tokenizer_from``);
* a SentencePiece-style vocabulary held only by tokenizer.json (Llama-2-style tokenizers saved by transformers
  5): upstream scores every token -1000, and llama.cpp then tokenizes differently from transformers (measured,
  tests/test_gguf.py); the wrapper scores them by merge rank, and the manifest notes it;
* llama.cpp's Phi-3 name quirk (:func:`safe_name`);
* the converter's byte progress drawn as quantkit's bar, its log kept for the error message.

Tested with llama.cpp b11312 (0c1e57098, llama-cpp-python 0.3.36's sdist), transformers 5.17.0, torch 2.13.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import BackendError, SourceModelError
from quantkit.formats import gguf_types as types
from quantkit.producers.gguf import quantize, tokenizer, tools
from quantkit.progress import Reporter
from quantkit.source import TOKENIZER_HINT, tokenizer_file

WRAPPER = Path(__file__).with_name("hf_to_gguf.py")
OUTTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}
_PERCENT = re.compile(r"Writing:\s+(\d+)%")
_LOG_ERROR = re.compile(r"^ERROR:[\w.-]+:(.+)$", re.MULTILINE)


@dataclass(frozen=True)
class Tensor:
    """One tensor of the GGUF file: its name, logical shape (outermost axis first) and type."""

    name: str
    shape: tuple[int, ...]
    type: str


@dataclass
class Plan:
    """What llama.cpp's converter will write for a checkpoint, found without writing (:func:`plan`)."""

    architecture: str | None  # the checkpoint's (LlamaForCausalLM)
    gguf_arch: str  # llama.cpp's (llama)
    model_class: str  # the converter's class (LlamaModel)
    block_count: int
    tensors: list[Tensor]
    name_map: dict[str, str]  # gguf-py's TensorNameMap for this architecture: HF module name -> GGUF base name
    tokenizer: str | None  # tokenizer.ggml.model (gpt2, llama...)
    phi3_tokens: bool  # the vocabulary has the tokens llama.cpp's Phi-3 fix-up looks up
    pre: str | None
    pre_from: str | None  # "upstream" (its hash check), "quantkit" (tokenizer.json's regex), None (no BPE)
    notes: list[str] = field(default_factory=list)

    def gguf_name(self, hf_module: str, suffix: str = ".weight") -> str | None:
        """The GGUF tensor a Hugging Face module's weight becomes, by gguf-py's own map; None when unmapped.

        A vision-language model's language model (``model.language_model.layers...`` in transformers 5) is named
        as upstream names it, without ``language_model.``; its vision modules have no name in the text file."""
        base = self.name_map.get(hf_module.replace("language_model.", ""))
        return base + suffix if base is not None else None


@dataclass
class Converted:
    """A written GGUF file and what the manifest says about it."""

    path: Path
    gguf_arch: str
    tokenizer: str | None
    pre: str | None
    pre_from: str | None
    n_tensors: int
    fallbacks: dict[str, str]  # tensor -> the type it got instead of the requested one (row size)


def run_wrapper(model_dir: Path, args: list[str], *, plan_only: bool, reporter: Reporter | None = None,
         label: str = "", part: str = "") -> dict[str, Any]:
    """Run the wrapper; returns its result, or raises SourceModelError (the converter refused) / BackendError.
    ``part`` names what of the checkpoint is converted in a refusal ("the vision side (mmproj) of ")."""
    conv = tools.require_converter("GGUF conversion").path
    pre, _ = tokenizer.match(model_dir)
    # The converter's own "Writing: N%" bar feeds quantkit's: TQDM_DISABLE (which quantkit sets for the libraries it
    # runs in-process) must not reach it, or the bar stays at 0% for the whole conversion.
    env = {**{k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"},
           "PYTHONPATH": os.pathsep.join([str(conv), str(conv / "gguf-py")]), "NO_LOCAL_GGUF": "1",
           "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="quantkit-convert-") as tmp:
        result = Path(tmp) / "result.json"
        argv = [sys.executable, "-P", str(WRAPPER), "--result", str(result), *(["--pre", pre] if pre else []),
                *(["--plan"] if plan_only else []), "--", str(model_dir), *args]
        log = _stream(argv, env, reporter, label)
        if not result.is_file():
            raise BackendError(f"llama.cpp's converter stopped without a result on {model_dir}; last lines:\n"
                               f"{tools.tail(log)}", hint=f"the command was: {' '.join(argv)}")
        out = json.loads(result.read_text())
    if "error" in out:
        raise _refusal(out, log, model_dir, part)
    return out


def _stream(argv: list[str], env: dict[str, str], reporter: Reporter | None, label: str) -> str:
    """Run ``argv``, its writing progress on quantkit's bar; returns its output (killed if we are interrupted)."""
    chunks: list[str] = []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, text=True, errors="replace", bufsize=1)
    try:
        assert proc.stdout is not None
        if reporter is None:
            chunks.append(proc.stdout.read())
        else:
            with reporter.bar(label, total=100, unit="%") as bar:
                done, recent = 0, ""
                while piece := proc.stdout.read(256):
                    chunks.append(piece)
                    recent = (recent + piece)[-512:]  # a percentage may straddle two reads
                    found = _PERCENT.findall(recent)
                    if found and int(found[-1]) > done:
                        bar.advance(int(found[-1]) - done)
                        done = int(found[-1])
        proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return "".join(chunks)


def _refusal(out: dict[str, Any], log: str, model_dir: Path, part: str = "") -> SourceModelError:
    """One line: the architecture (``part`` of it), and why llama.cpp's converter cannot convert it."""
    arch = out.get("architecture") or "this checkpoint"
    err = out["error"]
    logged = _LOG_ERROR.findall(log)
    reason = logged[-1].strip() if err["kind"] == "exit" and logged else err["message"]
    if err["kind"] == "pre_tokenizer":
        _, why = tokenizer.match(model_dir)
        return SourceModelError(
            f"{arch}: llama.cpp's converter does not recognise the tokenizer's pre-tokenizer (by its hash), and "
            f"quantkit cannot match it: {why[0] if why else 'no tokenizer.json'}",
            hint=f"llama.cpp implements these splitters (quantkit matches them by regex): {tokenizer.names()}; "
                 "or use the checkpoint's original tokenizer files")
    if err["kind"] == "tokenizer":
        missing = _missing_tokenizer_config(model_dir)
        read = f" ({tokenizer_file(model_dir)})" if missing is None else ""
        return SourceModelError(f"llama.cpp's converter cannot read the tokenizer of {model_dir}{read}: "
                                f"{err['message']}{missing or ''}", hint=TOKENIZER_HINT)
    return SourceModelError(f"llama.cpp's converter cannot convert {part}{arch}: {reason}",
                            hint="`python convert_hf_to_gguf.py --print-supported-models` (in "
                                 f"{tools.CONVERT_CACHE}) lists what it converts; or choose another method")


def _missing_tokenizer_config(model_dir: Path) -> str | None:
    """What a refusal says when the folder has a tokenizer but no tokenizer_config.json: the file that tells
    transformers the tokenizer's class and special tokens. Without it AutoTokenizer takes config.json's model type's
    default class, which may read the same tokenizer.json differently (measured: the MoE reference model's gains a
    token past config.json's vocab_size, and the converter's check of it fails); None otherwise."""
    if (model_dir / "tokenizer_config.json").is_file():
        return None
    return (f"; the folder has {tokenizer_file(model_dir)} but no tokenizer_config.json, so transformers read it "
            "as config.json's model type's default tokenizer")


_plans: dict[tuple[str, float], Plan] = {}


def plan(model_dir: Path) -> Plan:
    """What the converter will write for ``model_dir`` (computed once per folder state), or its refusal."""
    stamp = max((p.stat().st_mtime for p in model_dir.iterdir() if p.is_file()), default=0.0)
    key = (str(model_dir.resolve()), stamp)
    if key not in _plans:
        out = run_wrapper(model_dir, [], plan_only=True)
        _, notes = tokenizer.match(model_dir)
        _plans[key] = Plan(
            architecture=out.get("architecture"), gguf_arch=out["gguf_arch"], model_class=out["model_class"],
            block_count=int(out["block_count"]),
            tensors=[Tensor(n, tuple(s), t) for n, s, t in out["tensors"]], name_map=out["name_map"],
            tokenizer=out.get("tokenizer_model"), phi3_tokens=bool(out.get("phi3_tokens")),
            pre=out.get("pre_tokenizer"), pre_from=out.get("pre_from"),
            notes=notes if out.get("pre_from") == "quantkit" else [])
    return _plans[key]


def convert(model_dir: Path, out: Path, type_name: str, *, name: str, reporter: Reporter) -> Converted:
    """Write ``out`` as a GGUF of ``type_name`` with llama.cpp's converter, ``name`` as its ``general.name``."""
    args = ["--outtype", _outtype(model_dir, type_name), "--outfile", str(out), "--model-name",
            safe_name(name, plan(model_dir))]
    res = run_wrapper(model_dir, args, plan_only=False,
               reporter=reporter, label=f"Converting to GGUF {type_name} (llama.cpp's convert_hf_to_gguf.py)")
    import gguf

    reader = gguf.GGUFReader(out)

    def text(key: str) -> str | None:
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    notes = plan(model_dir).notes
    if res.get("scores_from") == "quantkit":
        note = ("token scores from tokenizer.json's BPE merge ranks (no tokenizer.model): llama.cpp's converter "
                "scores such a vocabulary -1000 throughout, and llama.cpp would then split text differently")
        if note not in notes:
            notes.append(note)
    if res.get("weight_only_from") == "quantkit":
        note = ("the repacked NVFP4 tensors are tagged to keep 8-bit activations (general.tensor_extra.prec_a4 false): "
                "the checkpoint quantizes weights only, and llama.cpp would run it with FP4 activations on Blackwell")
        if note not in notes:
            notes.append(note)
    if res.get("embedding_rows_from") == "quantkit":
        note = ("token_embd keeps every row of the checkpoint (no tokenizer.model): llama.cpp's Gemma 3 converter "
                "cuts it to the tokenizer's tokens but writes a vocabulary padded to vocab_size, and llama.cpp would "
                "refuse the file")
        if note not in notes:
            notes.append(note)
    return Converted(out, gguf_arch=text("general.architecture") or "", tokenizer=text("tokenizer.ggml.model"),
                     pre=text("tokenizer.ggml.pre"), pre_from=res.get("pre_from"), n_tensors=len(reader.tensors),
                     fallbacks=quantize.fallbacks(out, type_name))


# llama.cpp keys a Phi-3 tokenizer fix-up on general.name containing "phi3"/"phi-3", and fails to load the model
# when the vocabulary lacks the tokens it then looks up (measured: a Phi3ForCausalLM folder named tiny-phi3 with a
# Llama-2-style tokenizer.model converts, and llama.cpp refuses to load it).
_PHI3_NAME = re.compile(r"phi-?3", re.IGNORECASE)


def safe_name(name: str, p: Plan) -> str:
    """The model name for ``general.name``, spelled so llama.cpp's name-based quirks cannot break loading."""
    if _PHI3_NAME.search(name) and not p.phi3_tokens:
        note = (f"general.name is {_PHI3_NAME.sub('phi 3', name)!r}, not {name!r}: llama.cpp applies a Phi-3 "
                "tokenizer fix-up to names containing 'phi3' that this vocabulary cannot take")
        if note not in p.notes:
            p.notes.append(note)
        return _PHI3_NAME.sub("phi 3", name)
    return name


def _outtype(model_dir: Path, type_name: str) -> str:
    """The converter's ``--outtype`` for a type: its own; for a type repacked from the checkpoint (NVFP4), the
    precision the rest of the checkpoint is in, so the tensors that are not repacked are written unrounded."""
    if types.get(type_name).repacked:
        return OUTTYPES[source_type(sorted(model_dir.glob("*.safetensors")))]
    return OUTTYPES[type_name]


_FLOAT = {"F32", "F16", "BF16"}


def source_type(weight_files: list[Path]) -> str:
    """The lossless unquantized GGUF type for a checkpoint's floating-point weights (the quantizer's input); a
    quantized checkpoint's packed integers and 8-bit scales are not counted, its embeddings and norms are."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for f in weight_files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                sl: Any = h.get_slice(key)
                if sl.get_dtype() not in _FLOAT:
                    continue
                n = 1
                for d in sl.get_shape():
                    n *= d
                counts[sl.get_dtype()] = counts.get(sl.get_dtype(), 0) + n
    dominant = max(counts, key=lambda k: counts[k]) if counts else "F32"
    return {"BF16": "BF16", "F16": "F16"}.get(dominant, "F32")
