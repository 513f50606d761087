"""Importance matrices of mixture-of-experts models, for real: quantkit's per-expert sums and counts against
llama-imatrix's on the same tokens, llama.cpp reading quantkit's matrix, quantizing the MoE reference model with a
computed matrix, and the refusal of what quantkit does not compute.

The MoE reference model (trained: its router's choices have margins) must match llama-imatrix exactly: the same
token count for every expert, every column within 0.2%. Random Mixtral and DeepSeek-V3 checkpoints
(``tests/moe_models.py``) cover the other routers (DeepSeek-V3's sigmoid, group-limited choice with a score
bias, shared experts, a leading dense layer); a random router has near-ties, and llama.cpp's F32 logits and
transformers' float32 ones differ by float noise, so a few tokens in 2,048 pick another expert there. Everything
computed before the first router is held to the exact tolerance, the rest to one that a handful of re-routed
tokens stays within and a wrong name, expert order or input does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import ROOT
from gguf_spec import make
from moe_models import make_moe
from quantkit import api, recipe
from quantkit.errors import UsageError
from quantkit.producers.gguf import collect, convert, imatrix, quantize, tools
from quantkit.progress import Reporter
from test_gguf_imatrix import CHUNK, have_tools, kv, same_tokens  # noqa: F401

pytestmark = pytest.mark.e2e

gguf = pytest.importorskip("gguf")

MOE = ROOT / "models" / "quantkit-tiny-moe"
EXACT_ROW, EXACT_COLUMN = 1e-3, 2e-3  # relative difference of an expert's row (norm), of any single column
REROUTED_ROW, REROUTED_TOKENS = 3e-2, 4  # the same, after a few near-tie tokens (per expert) went elsewhere


def both(model_dir: Path, chunks: list[list[int]], text: Path, out: Path) -> tuple[imatrix.Imatrix, imatrix.Imatrix]:
    """quantkit's matrix of ``chunks``, and llama-imatrix's of the F32 GGUF over the text they came from."""
    ours, how = collect.compute(model_dir, convert.plan(model_dir), chunks, device="cpu", reporter=Reporter(quiet=True))
    assert how["dtype"] == "float32"
    r = recipe.load(None, {"model.source": str(model_dir), "output": str(out / "f32")},
                    base={"quantize": {"method": "gguf", "types": ["F32"]}})
    res = api.quantize_one(r, r.quantize, out / "f32")
    f32 = res.path / res.manifest.quantization["files"]["F32"]
    tools.run("llama-imatrix", ["-m", str(f32), "-f", str(text), "-o", str(out / "theirs.gguf"), "-c", str(CHUNK),
                                "-b", str(CHUNK), "--chunks", str(len(chunks)), "--no-ppl", "-t", "2"],
              purpose="the reference imatrix")
    return ours, imatrix.read(out / "theirs.gguf")


def row_difference(a: np.ndarray, b: np.ndarray) -> float:
    """The largest relative difference of one row (one expert, or the one matrix) between two entries."""
    return float((np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-12)).max())


def test_reference_moe_matches_llama_imatrix(same_tokens: dict[str, Any], have_tools: dict[str, Path],
                                             tmp_path: Path) -> None:
    ours, theirs = both(MOE, same_tokens["chunks"], same_tokens["text"], tmp_path)
    # q, k, v, o, the router and the three stacked expert tensors of both blocks, and nothing else
    assert set(ours.entries) == set(theirs.entries) and len(ours.entries) == 2 * 8
    for name, e in theirs.entries.items():
        mine = ours.entries[name]
        assert mine.sums.shape == e.sums.shape, name
        assert mine.counts.tolist() == e.counts.tolist(), (name, mine.counts, e.counts)
        assert row_difference(mine.sums, e.sums) < EXACT_ROW, (name, row_difference(mine.sums, e.sums))
        rel = np.abs(mine.sums - e.sums) / np.maximum(np.abs(e.sums), 1e-6)
        assert rel.max() < EXACT_COLUMN, (name, rel.max())
    experts = ours.entries["blk.1.ffn_down_exps.weight"]
    assert experts.sums.shape == (8, 256) and experts.counts.sum() == 16 * CHUNK * 2  # top-2 of every token
    assert len(set(experts.counts.tolist())) == 8  # skewed routing: the counts really are per expert
    for proj in ("gate", "up"):
        assert ours.entries[f"blk.1.ffn_{proj}_exps.weight"].counts.tolist() == experts.counts.tolist()

    # llama.cpp reads quantkit's per-expert layout (it stops on an expert count that does not fit) and re-saves it
    ours.datasets, ours.chunk_count, ours.chunk_size = ["test"], 16, CHUNK
    path, resaved = tmp_path / "ours.gguf", tmp_path / "resaved.gguf"
    imatrix.write_gguf(ours, path, arch="qwen3moe")
    f32 = next((tmp_path / "f32").glob("*.gguf"))
    tools.run("llama-imatrix", ["-m", str(f32), "--in-file", str(path), "-o", str(resaved), "-c", str(CHUNK)],
              purpose="re-saving quantkit's matrix")
    again = imatrix.read(resaved)
    for name, e in ours.entries.items():
        assert again.entries[name].counts.tolist() == e.counts.tolist(), name
        assert np.allclose(again.entries[name].sums, e.sums, rtol=1e-6), name


@pytest.mark.parametrize("family", ["mixtral", "deepseek3"])
def test_random_moe_families_match_llama_imatrix(family: str, same_tokens: dict[str, Any],
                                                 have_tools: dict[str, Path], tmp_path: Path) -> None:
    model_dir = make_moe(family, tmp_path / family)
    chunks = same_tokens["chunks"][:8]
    ours, theirs = both(model_dir, chunks, same_tokens["text"], tmp_path)
    # llama-imatrix also has MLA's attn_k_b/attn_v_b, which quantkit leaves out (and says so); nothing else differs
    assert set(ours.entries) == set(collect.covered(convert.plan(model_dir)))
    left_out = set(theirs.entries) - set(ours.entries)
    assert left_out == ({f"blk.{i}.attn_{s}_b.weight" for i in (0, 1) for s in "kv"} if family == "deepseek3"
                        else set())
    first_moe = min(int(n.split(".")[1]) for n in ours.entries if n.endswith("_exps.weight"))
    for name, mine in ours.entries.items():
        e = theirs.entries[name]
        block = int(name.split(".")[1])
        if block < first_moe or (block == first_moe and not name.endswith("_exps.weight")):
            # computed before any token could have been routed differently: exact
            assert mine.counts.tolist() == e.counts.tolist() == [len(chunks) * CHUNK], name
            assert row_difference(mine.sums, e.sums) < EXACT_ROW, (name, row_difference(mine.sums, e.sums))
            continue
        assert mine.counts.sum() == e.counts.sum(), name
        assert np.abs(mine.counts - e.counts).max() <= REROUTED_TOKENS, (name, mine.counts, e.counts)
        assert row_difference(mine.sums, e.sums) < REROUTED_ROW, (name, row_difference(mine.sums, e.sums))
    if family == "deepseek3":  # the shared expert sees every token
        assert ours.entries["blk.1.ffn_up_shexp.weight"].counts.tolist() == [len(chunks) * CHUNK]


def test_moe_artifact_with_computed_imatrix(have_tools: dict[str, Path], tmp_path: Path) -> None:
    """The MoE reference model quantized with a matrix computed from 16 x 256 calibration tokens: the per-expert
    counts in the manifest, the warning about rarely chosen experts, and llama-quantize applying it."""
    res = make(tmp_path / "out", ["F16", "Q4_K_M", "IQ2_M"], imatrix_=True, model=MOE,
               overrides={"calibration.min_expert_tokens": 300})
    out, q = res.path, res.manifest.quantization
    im = q["imatrix"]
    assert im["file"] == "imatrix/quantkit-tiny-moe.imatrix.gguf" and im["entries"] == 16
    assert im["types"] == ["Q4_K_M", "IQ2_M"]
    tokens = im["expert_tokens"]
    matrix = imatrix.read(out / im["file"])
    assert list(tokens["per_layer"]) == ["0", "1"] and tokens["threshold"] == 300
    for layer, counts in tokens["per_layer"].items():
        assert sum(counts) == 16 * 256 * 2
        assert counts == matrix.entries[f"blk.{layer}.ffn_down_exps.weight"].counts.tolist()
        assert tokens["below_threshold"].get(layer, []) == [e for e, n in enumerate(counts) if n < 300]
    assert tokens["below_threshold"] and tokens["min"] == min(min(c) for c in tokens["per_layer"].values())
    assert any("calibration tokens from the router" in n and "llama-quantize weighs" in n for n in res.manifest.notes)
    for t in ("Q4_K_M", "IQ2_M"):
        assert kv(out / q["files"][t])["quantize.imatrix.entries_count"] == 16
    # the stacked expert tensors are quantized differently than without the matrix
    plain = tmp_path / "plain.gguf"
    quantize.quantize(out / q["files"]["F16"], plain, "Q4_K_M")
    a = {t.name: bytes(t.data) for t in gguf.GGUFReader(plain).tensors}
    b = {t.name: bytes(t.data) for t in gguf.GGUFReader(out / q["files"]["Q4_K_M"]).tensors}
    assert all(a[f"blk.{i}.ffn_{p}_exps.weight"] != b[f"blk.{i}.ffn_{p}_exps.weight"]
               for i in (0, 1) for p in ("gate", "up", "down"))


def test_deepseek_mla_tensors_left_out_and_refused_where_needed(have_tools: dict[str, Path], tmp_path: Path) -> None:
    """DeepSeek-V3: K-quants are made, with a note naming the MLA tensors the matrix leaves out; the types llama.cpp
    makes only with a matrix entry for them are refused before any work, naming the way out."""
    model_dir = make_moe("deepseek3", tmp_path / "deepseek3")
    with pytest.raises(UsageError, match="IQ2_M cannot be made for DeepseekV3ForCausalLM with an importance "
                                         "matrix computed by quantkit") as e:
        make(tmp_path / "refused", ["Q4_K_M", "IQ2_M"], imatrix_=True, model=model_dir)
    assert "--imatrix-file FILE" in e.value.hint and not (tmp_path / "refused").exists()
    res = make(tmp_path / "out", ["Q4_K_M"], imatrix_=True, model=model_dir)
    assert any("4 block tensors have no entry" in n and "attn_k_b" in n for n in res.manifest.notes)
    assert res.manifest.quantization["imatrix"]["expert_tokens"]["per_layer"].keys() == {"1"}  # layer 0 is dense
