"""GGUF importance matrices and llama.cpp's own tools, for real: the types table against the built llama-quantize,
quantkit's importance matrix against llama-imatrix's on the same tokens, both file formats, quantizing with a
matrix exactly as llama-quantize does, the manifest's record, and every refusal before any work.

The tools are the ones ``make install`` builds (``scripts/build_llama_tools.sh``); these tests fail, not skip,
without them. Calibration is kept small (16 x 256 tokens) so the file runs in a few minutes on two cores.
"""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import ROOT, TINY, gone, live_children, quantkit
from gguf_spec import make
from quantkit import api, pipeline
from quantkit.devices import cores
from quantkit.errors import MissingToolError, UsageError
from quantkit.formats import gguf_types as types
from quantkit.producers.gguf import collect, imatrix, quantize, tools
from quantkit.seal import sha256_file

pytestmark = pytest.mark.e2e

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

CHUNK = 256  # llama-imatrix context = tokens per chunk


def kv(path: Path) -> dict[str, Any]:
    """A GGUF file's string and integer metadata."""
    out: dict[str, Any] = {}
    for name, f in gguf.GGUFReader(path).fields.items():
        if not f.data:
            continue
        part = f.parts[f.data[0]]
        out[name] = bytes(part).decode("utf-8", "replace") if f.types[0] == gguf.GGUFValueType.STRING else \
            part.tolist()[0] if len(part) == 1 else None
    return out


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="session")
def have_tools() -> dict[str, Path]:
    found = {t: tools.find(t) for t in tools.TOOLS}
    missing = [t for t, f in found.items() if f is None]
    assert not missing, f"llama.cpp's {', '.join(missing)} not found: run `make install` (or set {tools.ENV_VAR})"
    return {t: f.path for t, f in found.items() if f}


@pytest.fixture(scope="session")
def unquantized(tiny_gguf_f32_f16: Path) -> dict[str, Path]:
    """F32 and F16 GGUF files of the reference model, written by quantkit's converter (the session's, read only)."""
    files = json.loads((tiny_gguf_f32_f16 / "quantkit.json").read_text())["quantization"]["files"]
    return {t: tiny_gguf_f32_f16 / f for t, f in files.items()}


@pytest.fixture(scope="session")
def same_tokens(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A text, and the token chunks llama-imatrix makes of it: the text tokenized with BOS (llama.cpp's tokenizer
    and the checkpoint's are identical on this model: tests/test_gguf.py), cut into chunks of 256 whose first
    token llama-imatrix replaces by BOS."""
    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    with gzip.open(ROOT / "calibration" / "heldout.jsonl.gz", "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f if line.strip()]
    text = docs[0]
    for d in docs[1:]:
        if len(tok(text)["input_ids"]) > 17 * CHUNK:
            break
        text += "\n\n" + d
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) >= 17 * CHUNK
    chunks = [[tok.bos_token_id, *ids[k * CHUNK + 1:(k + 1) * CHUNK]] for k in range(16)]
    path = tmp_path_factory.mktemp("imx") / "text.txt"
    path.write_text(text, encoding="utf-8")
    return {"text": path, "chunks": chunks}


@pytest.fixture(scope="session")
def llama_imatrix(have_tools: dict[str, Path], unquantized: dict[str, Path], same_tokens: dict[str, Any],
                  tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama-imatrix's own matrices of the F32 file over the text's first 16 chunks, in both formats."""
    out = tmp_path_factory.mktemp("imx")
    files = {}
    for fmt in ("gguf", "dat"):
        files[fmt] = out / f"llama-imatrix.{fmt}"
        tools.run("llama-imatrix", ["-m", str(unquantized["F32"]), "-f", str(same_tokens["text"]), "-o",
                                    str(files[fmt]), "--output-format", fmt, "-c", str(CHUNK), "-b", str(CHUNK),
                                    "--chunks", "16", "--no-ppl", "-t", "2"], purpose="the reference imatrix")
    return files


# ------------------------------------------------------------------------------------------------------------
# the table


def test_types_module_is_light() -> None:
    code = ("import sys, quantkit.formats.gguf_types as t; "
            "print(sorted(m for m in ('gguf', 'llama_cpp', 'torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_table_covers_llama_quantize(have_tools: dict[str, Path]) -> None:
    """llama-quantize --help lists every type it offers as ``<ftype>  or  <NAME> : <description>``: each is a
    row of the table with that ftype, or one of its aliases (COPY is not a type)."""
    import re

    proc = subprocess.run([str(have_tools["llama-quantize"]), "--help"], capture_output=True, text=True)
    offered = {m[2]: int(m[1]) for m in re.finditer(r"^\s*(\d+)\s+or\s+(\S+)\s*:", proc.stdout + proc.stderr, re.M)}
    assert set(offered) == set(types.NAMES) | set(types.ALIASES)
    for name, ftype in offered.items():
        assert types.get(name).ftype_id == ftype, name
    for alias, target in types.ALIASES.items():
        assert types.canonical(alias.lower()) == target


def test_table_matches_what_llama_cpp_makes(unquantized: dict[str, Path], tmp_path: Path) -> None:
    """Every llama.cpp-made type, quantized without a matrix: made (with the ftype and bulk type the table says)
    exactly when the table says it needs none; refused by llama.cpp otherwise."""
    for t in types.TYPES.values():
        if not t.quantized_by_llama_cpp:
            continue
        dst = tmp_path / f"{t.name}.gguf"
        if t.needs_imatrix:
            with pytest.raises(Exception, match="status 1"):
                quantize.quantize(unquantized["F16"], dst, t.name)
            continue
        quantize.quantize(unquantized["F16"], dst, t.name)
        if t.refused:  # Q2_0: llama.cpp makes it, gguf-py 0.19.0 cannot read it back
            with pytest.raises(ValueError, match="is not a valid GGMLQuantizationType"):
                gguf.GGUFReader(dst)
            continue
        assert kv(dst)["general.file_type"] == t.ftype_id, t.name
        bulk = "Q8_0" if t.name == "MXFP4_MOE" else t.bulk  # MXFP4 is for experts: a dense model is Q8_0
        assert bulk in set(tensor_types(dst).values()), (t.name, set(tensor_types(dst).values()))
        dst.unlink()


def test_library_and_llama_quantize_write_the_same_file(unquantized: dict[str, Path], tmp_path: Path) -> None:
    """One llama.cpp: the in-process library path and the built tool quantize to identical bytes."""
    lib, tool = tmp_path / "lib.gguf", tmp_path / "tool.gguf"
    quantize.quantize(unquantized["F16"], lib, "Q4_K_M", nthread=2)
    tools.run("llama-quantize", [str(unquantized["F16"]), str(tool), "Q4_K_M", "2"], purpose="the test")
    assert lib.read_bytes() == tool.read_bytes()


# ------------------------------------------------------------------------------------------------------------
# computing the matrix


def test_imatrix_matches_llama_imatrix_on_the_same_tokens(llama_imatrix: dict[str, Path], same_tokens: dict[str, Any],
                                                          unquantized: dict[str, Path], tmp_path: Path) -> None:
    from quantkit.producers.gguf import convert
    from quantkit.progress import Reporter

    ours, how = collect.compute(TINY, convert.plan(TINY), same_tokens["chunks"], device="cpu",
                                reporter=Reporter(quiet=True))
    assert how["device"] == "cpu" and how["dtype"] == "float32"
    theirs = imatrix.read(llama_imatrix["gguf"])
    assert theirs.format == "gguf" and theirs.chunk_count == 16 and theirs.chunk_size == CHUNK
    # every matrix of the 8 blocks (q, k, v, o, gate, up, down), and nothing else
    assert set(ours.entries) == set(theirs.entries) and len(ours.entries) == 8 * 7
    for name, e in theirs.entries.items():
        mine = ours.entries[name]
        assert mine.counts.tolist() == e.counts.tolist() == [16 * CHUNK], name
        rel = np.abs(mine.sums - e.sums) / np.maximum(np.abs(e.sums), 1e-6)
        assert np.linalg.norm(mine.sums - e.sums) / np.linalg.norm(e.sums) < 1e-4, name
        assert rel.max() < 2e-3, (name, rel.max())

    # written in the GGUF format and read back (by quantkit, and by llama-imatrix itself, which re-saves it)
    ours.datasets, ours.chunk_count, ours.chunk_size = ["test"], 16, CHUNK
    path = tmp_path / "ours.gguf"
    imatrix.write_gguf(ours, path, arch="llama")
    back = imatrix.read(path)
    assert back.datasets == ["test"] and back.chunk_count == 16 and back.chunk_size == CHUNK
    for name, e in ours.entries.items():
        assert np.array_equal(back.entries[name].sums, e.sums) and back.entries[name].counts.tolist() == [4096]
    resaved = tmp_path / "resaved.gguf"
    tools.run("llama-imatrix", ["-m", str(unquantized["F32"]), "--in-file", str(path), "-o", str(resaved),
                                "-c", str(CHUNK)],
              purpose="re-saving quantkit's matrix")
    again = imatrix.read(resaved)
    for name, e in ours.entries.items():
        assert np.allclose(again.entries[name].sums, e.sums, rtol=1e-6), name


def test_legacy_dat_reads_as_the_same_matrix(llama_imatrix: dict[str, Path]) -> None:
    g, d = imatrix.read(llama_imatrix["gguf"]), imatrix.read(llama_imatrix["dat"])
    assert d.format == "dat" and d.chunk_count == 16 and set(d.entries) == set(g.entries)
    for name, e in g.entries.items():
        # legacy entries hold (sum / count) * ncall with ncall = count / chunk size
        ncall = d.entries[name].counts[0]
        assert ncall == 16
        assert np.allclose(d.entries[name].sums / ncall, e.sums / e.counts[:, None], rtol=1e-5), name


# ------------------------------------------------------------------------------------------------------------
# quantizing with it


@pytest.fixture(scope="session")
def computed(tmp_path_factory: pytest.TempPathFactory, have_tools: dict[str, Path]) -> api.ArtifactResult:
    """Q4_K_M and IQ2_M (which needs a matrix) with a matrix computed from 16 x 256 calibration tokens."""
    return make(tmp_path_factory.mktemp("imx") / "computed", ["Q4_K_M", "IQ2_M"], imatrix_=True)


def test_computed_imatrix_artifact(computed: api.ArtifactResult, have_tools: dict[str, Path]) -> None:
    out, m = computed.path, computed.manifest
    q = m.quantization
    im = q["imatrix"]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "imatrix/quantkit-tiny.imatrix.gguf", "quantkit-tiny-IQ2_M.gguf", "quantkit-tiny-Q4_K_M.gguf",
        "quantkit.json"]
    assert im["file"] == "imatrix/quantkit-tiny.imatrix.gguf" and im["format"] == "gguf"
    assert im["sha256"] == sha256_file(out / im["file"]) == m.files[im["file"]].sha256
    assert im["source"] == "calibration" and im["types"] == ["Q4_K_M", "IQ2_M"] and im["entries"] == 56
    # the calibration set is recorded as for every other method, and the matrix names its exact tokens
    assert m.calibration.samples == 16 and m.calibration.seq_len == 256
    assert im["calibration_tokens_sha256"] == m.calibration.tokens_sha256
    assert im["datasets"][0] == f"quantkit tokens sha256:{m.calibration.tokens_sha256}"
    assert im["chunks"] == 16 and im["chunk_size"] == 256 and im["computed_with"]["engine"] == "transformers"
    applied = im["applied_by"]
    assert applied["tool"] == "llama-quantize" and applied["commit"] == "0c1e57098"
    assert applied["built_for"] == "llama-cpp-python 0.3.36"
    # llama-quantize recorded the matrix in each quantized file, as for any llama.cpp user
    for t in ("Q4_K_M", "IQ2_M"):
        meta = kv(out / q["files"][t])
        assert meta["quantize.imatrix.dataset"] == im["datasets"][0]
        assert meta["quantize.imatrix.entries_count"] == 56 and meta["quantize.imatrix.chunks_count"] == 16
        assert meta["general.file_type"] == types.get(t).ftype_id
    assert "IQ2_S" in tensor_types(out / q["files"]["IQ2_M"]).values()
    assert quantkit("verify", out).returncode == 0
    card = pipeline.imatrix_line(im)  # the model card's sentence
    assert im["sha256"] in card and m.calibration.tokens_sha256 in card and "b11312 (0c1e57098)" in card
    # llama-quantize named as the card names every tool: its build and what it was built for
    assert card.endswith("applied to Q4_K_M, IQ2_M by llama-quantize b11312 (0c1e57098), built for "
                         "llama-cpp-python 0.3.36."), card


def test_imatrix_changes_the_quantized_weights(computed: api.ArtifactResult, unquantized: dict[str, Path],
                                               tmp_path: Path) -> None:
    plain = tmp_path / "plain.gguf"
    quantize.quantize(unquantized["F16"], plain, "Q4_K_M")
    a = {t.name: bytes(t.data) for t in gguf.GGUFReader(plain).tensors}
    b = {t.name: bytes(t.data) for t in gguf.GGUFReader(computed.path / "quantkit-tiny-Q4_K_M.gguf").tensors}
    assert set(a) == set(b)
    changed = {n for n in a if a[n] != b[n]}
    # every block matrix is quantized differently; embeddings and output (not in the matrix) and norms are not
    assert {n for n in changed if not n.startswith("blk.")} == set()
    assert len([n for n in changed if n.endswith(("attn_q.weight", "ffn_down.weight"))]) == 16


@pytest.mark.parametrize("fmt", ["gguf", "dat"])
def test_given_imatrix_is_applied_exactly_as_llama_quantize_does(fmt: str, llama_imatrix: dict[str, Path],
                                                                  unquantized: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    given = llama_imatrix[fmt]
    res = make(tmp_path / "given", ["F16", "IQ3_M"], imatrix_file=given)
    im = res.manifest.quantization["imatrix"]
    assert im["source"] == "file" and im["given"] == str(given) and im["format"] == fmt
    assert im["file"] == f"imatrix/quantkit-tiny.imatrix.{fmt}" and im["sha256"] == sha256_file(given)
    assert (res.path / im["file"]).read_bytes() == given.read_bytes()
    assert res.manifest.calibration is None  # nothing was calibrated here
    # the same file llama-quantize --imatrix writes from the same F16 file
    direct = tmp_path / "direct.gguf"
    tools.run("llama-quantize", ["--imatrix", str(res.path / im["file"]), str(res.path / "quantkit-tiny-F16.gguf"),
                                 str(direct), "IQ3_M", str(cores())], purpose="the test")
    ours = {t.name: bytes(t.data) for t in gguf.GGUFReader(res.path / "quantkit-tiny-IQ3_M.gguf").tensors}
    theirs = {t.name: bytes(t.data) for t in gguf.GGUFReader(direct).tensors}
    assert ours == theirs


# ------------------------------------------------------------------------------------------------------------
# refusals, before any work


@pytest.mark.parametrize("t", ["IQ2_M", "IQ1_S", "IQ3_XXS", "Q2_K_S"])
def test_types_that_need_a_matrix_are_refused_without_one(t: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=f"{t} needs an importance matrix") as e:
        make(tmp_path / "out", ["Q4_K_M", t])
    assert "--imatrix " in e.value.hint and "--imatrix-file FILE" in e.value.hint
    assert not (tmp_path / "out").exists()


def test_other_refusals(tmp_path: Path, llama_imatrix: dict[str, Path], unquantized: dict[str, Path]) -> None:
    cases = [
        (dict(types_=["Q2_0"]), "gguf-py 0.19.0 cannot read Q2_0"),
        (dict(types_=["F16", "Q8_0"], imatrix_=True), "only used by types llama.cpp quantizes"),
        (dict(types_=["Q4_K_M"], imatrix_=True, imatrix_file=llama_imatrix["gguf"]), "were both given"),
        (dict(types_=["Q4_K_M"], imatrix_file=tmp_path / "nope.gguf"), "does not exist"),
        (dict(types_=["Q4_K_M"], imatrix_file=unquantized["F16"]), "not an importance matrix"),
        (dict(types_=["Q4_K_M"], imatrix_file=ROOT / "README.md"), "neither a GGUF importance matrix nor"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UsageError, match=message):
            make(tmp_path / "out", **kwargs)
        assert not (tmp_path / "out").exists()


def test_a_matrix_for_another_model_is_refused(tmp_path: Path, llama_imatrix: dict[str, Path]) -> None:
    # the reference model with one block's matrices renamed and another's resized: made for another model
    im = imatrix.read(llama_imatrix["gguf"])
    im.entries["blk.3.ffn_down.weight"] = imatrix.Entry(np.ones((1, 100), np.float32), np.ones(1, np.float32))
    path = tmp_path / "other.gguf"
    imatrix.write_gguf(im, path, arch="llama")
    with pytest.raises(UsageError, match=r"does not fit this model: blk.3.ffn_down.weight \(100 values"):
        make(tmp_path / "out", ["Q4_K_M"], imatrix_file=path)
    im.entries = {k.replace("blk.", "layer."): v for k, v in im.entries.items()}
    imatrix.write_gguf(im, path, arch="llama")
    with pytest.raises(UsageError, match="names none of this model's tensors"):
        make(tmp_path / "out", ["Q4_K_M"], imatrix_file=path)


def test_missing_tool_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tools.ENV_VAR, str(tmp_path))  # a folder without the tools: nothing else is looked at
    with pytest.raises(MissingToolError, match="needs llama.cpp's llama-quantize") as e:
        make(tmp_path / "out", ["Q4_K_M"], imatrix_=True)
    assert "make install" in e.value.hint and e.value.exit_code == 1
    assert not (tmp_path / "out").exists()


# Quantizing with a matrix through the API in a child Python, the way the CLI runs it (signals routed by
# quantkit.interrupts); IQ2_XS and IQ1_S keep llama-quantize busy for a few seconds each on this model. The matrix is
# llama-imatrix's, given as a file: computing one first (what test_computed_imatrix_artifact checks) would only delay
# the moment the signal is about.
QUANTIZE_IN_A_CHILD = """
import sys
from pathlib import Path
sys.path.insert(1, "tests")
from gguf_spec import make
from quantkit import interrupts
interrupts.install()
try:
    make(Path(sys.argv[1]), ["IQ2_XS", "IQ1_S", "IQ2_M"], imatrix_file=Path(sys.argv[2]))
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signal_while_llama_quantize_runs_stops_it_and_cleans_up(have_tools: dict[str, Path],
                                                                  llama_imatrix: dict[str, Path], tmp_path: Path,
                                                                  sig: signal.Signals) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", QUANTIZE_IN_A_CHILD, str(out), str(llama_imatrix["gguf"])],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    quantizer = None
    deadline = time.monotonic() + 300
    while quantizer is None and proc.poll() is None and time.monotonic() < deadline:
        quantizer = next((c for c, cmd in live_children(proc.pid)
                          if cmd and Path(cmd[0]).name == "llama-quantize"), None)
        time.sleep(0.05)
    assert quantizer is not None, "llama-quantize never started: " + (proc.stderr.read() if proc.stderr else "")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert gone(quantizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "partial output or lock left behind"
