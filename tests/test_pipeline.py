"""``quantkit run``: a multi-output recipe end to end, the bundle, resuming, and a failing gate (exit 3)."""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from pathlib import Path

import pytest
import yaml

from quantkit import integrity
from quantkit.locks import output_lock
from quantkit.manifest import MANIFEST, read_manifest

from conftest import TINY, quantkit

pytestmark = pytest.mark.e2e

RECIPE = f"""\
# test release: two llm-compressor formats and two GGUF types
model:
  source: {TINY}
output: release
outputs:
  - method: rtn
  - method: gptq
  - method: gguf
    types: [Q8_0, Q4_K_M]
calibration:
  dataset: mixed
  samples: 8
  seq_len: 128
evaluation:
  dataset: heldout
  ctx: 512
  max_tokens: 4096
  tasks:
    - task: quantkit_lastword_gen
      limit: 8
    - task: quantkit_nextsentence
      limit: 8
smoke:
  timeout: 120
"""


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    work = tmp_path_factory.mktemp("run")
    (work / "recipe.yaml").write_text(RECIPE)
    proc = quantkit("run", "recipe.yaml", "--json", cwd=work, check=True)
    return work, json.loads(proc.stdout), proc.stderr


def test_every_output_is_built_evaluated_and_smoked_where_possible(release) -> None:
    work, report, _ = release
    assert report["ok"] is True
    outs = {o["name"]: o for o in report["outputs"]}
    assert set(outs) == {"rtn-w4g128", "gptq-w4g128", "gguf"}
    assert all(o["status"] == "built" for o in outs.values())
    for o in outs.values():
        assert o["evaluation"]["results"], o["name"]
        assert all(g["passed"] for g in o["gates"])
    for name in ("rtn-w4g128", "gptq-w4g128"):  # the recipe's tasks, scored in transformers against the baseline
        rows = outs[name]["evaluation"]["tasks"]
        assert {(r["task"], r["metric"]) for r in rows} == {("quantkit_lastword_gen", "exact_match,first-word"),
                                                          ("quantkit_nextsentence", "acc"),
                                                          ("quantkit_nextsentence", "acc_norm")}
        assert all(r["samples"] == 8 and r["engine"] == "transformers" for r in rows)
        assert all(r["recovery"] == pytest.approx(r["artifact"] / r["baseline"]) for r in rows if r["baseline"])
    # GGUF: the generation task through llama-server for each file; the multiple-choice one skipped, saying why
    gguf_rows = outs["gguf"]["evaluation"]["tasks"]
    assert {(r["task"], Path(r["label"]).name) for r in gguf_rows} == {
        ("quantkit_lastword_gen", "quantkit-tiny-Q8_0.gguf"), ("quantkit_lastword_gen", "quantkit-tiny-Q4_K_M.gguf")}
    assert outs["gguf"]["evaluation"]["tasks_skipped"]["tasks"] == ["quantkit_nextsentence"]
    gguf_files = {r["file"] for r in outs["gguf"]["evaluation"]["results"]}
    assert gguf_files == {"quantkit-tiny-Q8_0.gguf", "quantkit-tiny-Q4_K_M.gguf"}
    # llama.cpp's server ran for real on the GGUF files; without vLLM on a GPU the others say skipped, not passed.
    assert outs["gguf"]["smoke"]["status"] == "passed" and len(outs["gguf"]["smoke"]["runs"]) == 2
    for name in ("rtn-w4g128", "gptq-w4g128"):
        smoke = outs[name]["smoke"]
        assert smoke["status"] in ("skipped", "passed")
        if smoke["status"] == "skipped":
            assert "vllm" in smoke["summary"].lower()


def test_bundle_has_sums_reports_plot_and_model_cards(release) -> None:
    work, _, _ = release
    rel = work / "release"
    for name in ("SHA256SUMS", "report.md", "report.json"):
        assert (rel / name).exists(), name
    assert list(rel.glob("*.png")), "size/perplexity plot missing"
    for line in (rel / "SHA256SUMS").read_text().splitlines():
        digest, path = line.split("  ", 1)
        assert hashlib.sha256((rel / path).read_bytes()).hexdigest() == digest, path
    for art in ("rtn-w4g128", "gptq-w4g128", "gguf"):
        card = (rel / art / "README.md").read_text()
        assert "base_model" not in card.split("---")[1], card  # a local source has no hub id to name
        assert f"Quantized from `{TINY.name}`" in card
        assert "## Evaluation" in card and "```yaml" in card
        assert art == "gguf" or "## Task accuracy" in card
        # the multiple-choice task llama-server cannot score is said on the GGUF's card, never passed over
        assert (art == "gguf") == ("Not scored: quantkit_nextsentence (llama-server gives no prompt" in card), art
        assert integrity.verify(rel / art).ok
        # the evaluation section: its protocol, each row named (a GGUF file, else the output), its gates' verdicts
        evaluation = card[card.index("## Evaluation"):card.index("## Smoke test")]
        assert "Protocol: 4,096 tokens of `heldout` (dataset `heldout`), ctx 512" in evaluation, evaluation
        assert "| None |" not in evaluation and "## Gates\n\nAll gates pass." in evaluation, evaluation
        assert art == "gguf" or f"\n| {art} | " in evaluation, evaluation
    # a GGUF output's task rows, one per file, say which file each scored
    card = (rel / "gguf" / "README.md").read_text()
    tasks = card[card.index("## Task accuracy"):card.index("## Gates")]
    assert "| file | task | metric |" in tasks, tasks
    for name in ("quantkit-tiny-Q8_0.gguf", "quantkit-tiny-Q4_K_M.gguf"):
        assert f"| {name} | quantkit_lastword_gen | exact_match,first-word |" in tasks, tasks


def test_a_model_card_shows_no_path_of_the_machine_that_made_it(release) -> None:
    """A card is public (``publish`` uploads it): the source by its folder's name, tools by name and build, never
    the converter's cache folder, llama-quantize's path or the source's, which qa3 found in one. The manifest, the
    build record, keeps them (docs/manifest.md)."""
    work, _, _ = release
    rel = work / "release"
    local = (str(TINY.parent), str(work), str(Path.home()), tempfile.gettempdir())
    for art in ("rtn-w4g128", "gptq-w4g128", "gguf"):
        card = (rel / art / "README.md").read_text()
        assert [p for p in local if p in card] == [], art
        assert f"\n  source: {TINY.name}\n" in card, art
    card = (rel / "gguf" / "README.md").read_text()
    tool = r"\n\| converter \| convert_hf_to_gguf\.py b\d+ \([0-9a-f]{9}\), built for llama-cpp-python \S+ \|\n"
    assert re.search(tool, card), card
    m = read_manifest(rel / "gguf")
    assert m.source.path == str(TINY.resolve()) and Path(m.quantization["converter"]["path"]).is_absolute()


def test_rerun_redoes_nothing(release) -> None:
    work, first, first_log = release
    created = {a: read_manifest(work / "release" / a).created for a in ("rtn-w4g128", "gptq-w4g128", "gguf")}
    proc = quantkit("run", "recipe.yaml", "--json", cwd=work, check=True)
    again = json.loads(proc.stdout)
    assert {o["status"] for o in again["outputs"]} == {"reused"}
    # the first run logged loading the baseline to score it; the second loads no model at all
    assert "loading baseline in" in first_log and "loading " not in proc.stderr, proc.stderr
    for a, when in created.items():
        assert read_manifest(work / "release" / a).created == when
    assert [o["evaluation"] for o in again["outputs"]] == [o["evaluation"] for o in first["outputs"]]
    # each artifact against its manifest, then the whole release against the SHA256SUMS the run wrote
    assert [(r.seal, r.ok) for r in integrity.verify_tree(work / "release")] == \
        [(MANIFEST, True)] * 3 + [(integrity.SUMS, True)]


def test_failing_gate_exits_3_and_names_it(release) -> None:
    work, _, _ = release
    text = RECIPE.replace("  max_tokens: 4096\n", "  max_tokens: 4096\n  gates: {min_top1: 0.9999}\n")
    text = text.replace("output: release", "output: release-strict")
    (work / "strict.yaml").write_text(text.replace("  - method: gptq\n", "").replace(
        "  - method: gguf\n    types: [Q8_0, Q4_K_M]\n", ""))
    proc = quantkit("run", "strict.yaml", "--no-smoke", cwd=work)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "min_top1" in proc.stderr and "0.9999" in proc.stderr and "Traceback" not in proc.stderr
    assert (work / "release-strict" / "report.json").exists()  # the bundle is still written for inspection


def test_calibration_changes_rebuild_only_outputs_that_read_calibration(release) -> None:
    """RTN and GGUF without an importance matrix read no calibration data: a new calibration block reuses them."""
    work, _, _ = release
    text = RECIPE.replace("  samples: 8\n", "  samples: 16\n").replace("  - method: gptq\n", "")
    (work / "more-samples.yaml").write_text(text)
    proc = quantkit("run", "more-samples.yaml", "--no-eval", "--no-smoke", "--json", cwd=work, check=True)
    assert {o["name"]: o["status"] for o in json.loads(proc.stdout)["outputs"]} == {"rtn-w4g128": "reused",
                                                                                     "gguf": "reused"}


def test_summary_shows_status_and_smoke_for_every_gguf_file(release) -> None:
    work, _, _ = release
    table = quantkit("run", "recipe.yaml", cwd=work, check=True).stdout
    rows = [line for line in table.splitlines() if ".gguf" in line]
    assert len(rows) == 2, table
    for line in rows:
        assert "reused" in line and "passed" in line, line


def test_a_source_whose_weights_changed_is_not_reused(tmp_path: Path) -> None:
    """The same config.json with other weight bytes (a checkpoint re-exported or fine-tuned in place) is another
    source: ``run`` refuses to reuse its artifact, and ``eval`` refuses it as the baseline."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(TINY, src)
    (tmp_path / "r.yaml").write_text(f"model:\n  source: {src}\noutput: rel\noutputs:\n  - method: rtn\n")
    first = quantkit("run", "r.yaml", "--no-eval", "--no-smoke", "--json", cwd=tmp_path, check=True)
    assert [o["status"] for o in json.loads(first.stdout)["outputs"]] == ["built"]
    recorded = read_manifest(tmp_path / "rel" / "rtn-w4g128").source.weights_sha256
    assert recorded and len(recorded) == 64

    tensors = load_file(src / "model.safetensors")
    name = next(n for n in tensors if "layers.0.mlp.down_proj" in n)
    tensors[name] = tensors[name] * 3
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    proc = quantkit("run", "r.yaml", "--no-eval", "--no-smoke", cwd=tmp_path)
    assert proc.returncode == 2 and "the source model's weights changed" in proc.stderr, proc.stderr[-2000:]
    dry = quantkit("run", "r.yaml", "--no-eval", "--no-smoke", "--dry-run", cwd=tmp_path)  # a pre-flight check
    assert dry.returncode == 2 and "cannot be reused" in dry.stderr, dry.stderr[-2000:]  # refuses as the run does
    proc = quantkit("eval", "rel/rtn-w4g128", "--baseline", src, "--max-tokens", "256", "--ctx", "256",
                    cwd=tmp_path)
    assert proc.returncode == 2 and "other weights than the baseline" in proc.stderr, proc.stderr[-2000:]
    proc = quantkit("run", "r.yaml", "--no-eval", "--no-smoke", "--force", "--json", cwd=tmp_path, check=True)
    assert [o["status"] for o in json.loads(proc.stdout)["outputs"]] == ["built"]
    assert read_manifest(tmp_path / "rel" / "rtn-w4g128").source.weights_sha256 != recorded


def _two_outputs(work: Path, extra: str = "") -> None:
    (work / "r.yaml").write_text(f"model:\n  source: {TINY}\noutput: rel\noutputs:\n  - method: rtn\n"
                                 f"  - method: gguf\n    types: [Q8_0]\n{extra}")


@pytest.mark.parametrize("task, why", [("{task: quantkit_lastwrod, limit: 3}", "does not know a task called"),
                                       ("{task: quantkit_lastword, limit: 3, min_recovery: {acc_norm: 0.9}}",
                                        "does not report the metric 'acc_norm'")])
def test_a_recipe_task_mistake_is_refused_before_anything_is_built(tmp_path: Path, task: str, why: str) -> None:
    """A task lm-eval does not know, or a gate on a metric the task does not report, is a recipe error (exit 2) in
    ``run`` and its ``--dry-run``, found before any model loads: never a task skipped with the release passing."""
    _two_outputs(tmp_path, f"evaluation:\n  tasks:\n    - {task}\n")
    for flags in (["--dry-run"], ["--no-smoke"]):
        proc = quantkit("run", "r.yaml", *flags, cwd=tmp_path)
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "rel").exists()


def test_a_release_is_written_by_one_run_at_a_time(tmp_path: Path) -> None:
    _two_outputs(tmp_path)
    with output_lock(tmp_path / "rel"):  # what a run in progress holds
        proc = quantkit("run", "r.yaml", "--no-eval", "--no-smoke", cwd=tmp_path)
    assert proc.returncode == 2 and "another quantkit process" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "rel").exists()


def test_a_run_cut_short_leaves_no_seal_vouching_for_a_changed_release(tmp_path: Path) -> None:
    """The last run's SHA256SUMS and report.json go before anything in the release changes: interrupted while it
    rebuilds, a release has no seal (``verify`` says so) until a run completes it again."""
    import os
    import signal
    import subprocess
    import sys

    _two_outputs(tmp_path)
    quantkit("run", "r.yaml", "--no-eval", "--no-smoke", cwd=tmp_path, check=True)
    rel = tmp_path / "rel"
    assert (rel / "SHA256SUMS").exists() and (rel / "report.json").exists()
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "run", "r.yaml", "--no-eval", "--no-smoke", "--force"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # the second output's build has begun: the first one is already replaced
        seen.append(line)
        if "▶ gguf" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, "".join(seen) + rest
    assert not (rel / "SHA256SUMS").exists() and not (rel / "report.json").exists()
    quantkit("run", "r.yaml", "--no-eval", "--no-smoke", cwd=tmp_path, check=True)
    assert (rel / "SHA256SUMS").exists() and json.loads((rel / "report.json").read_text())["ok"] is True


def test_a_one_output_release_sums_check_out(tmp_path: Path) -> None:
    """A one-output release is its artifact: its SHA256SUMS holds (as ``sha256sum -c`` reads it) although the
    manifest is rewritten after it, and the manifest vouches for the bundle's files."""
    (tmp_path / "one.yaml").write_text(f"model:\n  source: {TINY}\noutput: one\nquantize:\n  method: rtn\n")
    quantkit("run", "one.yaml", "--no-eval", "--no-smoke", cwd=tmp_path, check=True)
    rel = tmp_path / "one"
    for line in (rel / "SHA256SUMS").read_text().splitlines():
        digest, path = line.split("  ", 1)
        assert hashlib.sha256((rel / path).read_bytes()).hexdigest() == digest, path
    assert {"SHA256SUMS", "report.json"} <= set(read_manifest(rel).files) and integrity.verify(rel).ok


def test_a_release_folder_holding_the_users_files_is_refused(tmp_path: Path) -> None:
    """SHA256SUMS seals everything in a release folder: a file of the user's there would ship as part of it."""
    _two_outputs(tmp_path)
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "notes.txt").write_text("mine\n")
    for flags in (["--dry-run"], ["--no-eval", "--no-smoke"]):
        proc = quantkit("run", "r.yaml", *flags, cwd=tmp_path)
        assert proc.returncode == 2 and "holds what quantkit did not write: notes.txt" in proc.stderr, \
            proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "rel").iterdir()) == ["notes.txt"]


def test_a_hidden_file_of_the_users_in_a_release_folder_is_refused(tmp_path: Path) -> None:
    """A ``.env`` in a release folder would be sealed into SHA256SUMS and uploaded by ``publish``: hidden is not
    quantkit's. What a killed run leaves hidden there (a lock, a half-built output, an atomic write's temporary) is."""
    _two_outputs(tmp_path)
    rel = tmp_path / "rel"
    rel.mkdir()
    (rel / ".rtn-w4g128.lock").touch()
    (rel / ".gguf.partial-4242").mkdir()
    (rel / ".report.json.tmp-4242").touch()
    (rel / ".quantkit-probe-k2x9_q1").mkdir()  # check_writable's, left by a run killed between its mkdir and rmdir
    quantkit("run", "r.yaml", "--dry-run", cwd=tmp_path, check=True)
    (rel / ".env").write_text("HF_TOKEN=hf_secret\n")
    proc = quantkit("run", "r.yaml", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2 and "holds what quantkit did not write: .env" in proc.stderr, proc.stderr[-2000:]


def test_a_killed_runs_half_built_output_is_not_sealed_into_the_release(tmp_path: Path) -> None:
    """A ``run --force`` killed while building an output leaves its half-built copy (``.NAME.partial-PID``) and may
    leave the old one moved aside (``.NAME.old-PID``). Only a run that builds that output again cleared them, so a
    run that reused it sealed the half-built files into the release's SHA256SUMS. The run clears them first."""
    _two_outputs(tmp_path)
    quantkit("run", "r.yaml", "--no-eval", "--no-smoke", cwd=tmp_path, check=True)
    rel = tmp_path / "rel"
    half = rel / ".gguf.partial-4242"
    half.mkdir()
    (half / "quantkit-tiny-Q8_0.gguf").write_bytes(b"GGUF cut short")
    old = rel / ".rtn-w4g128.old-4242"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"the old weights")
    proc = quantkit("run", "r.yaml", "--no-eval", "--no-smoke", "--json", cwd=tmp_path, check=True)
    assert {o["status"] for o in json.loads(proc.stdout)["outputs"]} == {"reused"}
    assert not half.exists() and not old.exists()
    assert "4242" not in (rel / "SHA256SUMS").read_text()
    quantkit("verify", "rel", cwd=tmp_path, check=True)


def test_a_smoke_of_an_artifact_in_a_release_logs_beside_the_release(tmp_path: Path) -> None:
    """``quantkit smoke rel/gguf`` wrote its server log beside the artifact, into the release, and the next
    ``quantkit run``, which seals the release anew over the smoke's record in the artifact's manifest, refused the
    release as holding a file it did not write. The log goes beside the release (``rel.gguf.smoke-...log``), as a
    kernel sweep's logs do."""
    from quantkit.engines.vllm import tune

    _two_outputs(tmp_path)
    quantkit("run", "r.yaml", "--no-eval", "--no-smoke", cwd=tmp_path, check=True)
    rel = tmp_path / "rel"
    before = sorted(p.name for p in rel.iterdir())
    smoke = json.loads(quantkit("smoke", "rel/gguf", "--json", cwd=tmp_path, check=True).stdout)
    [run] = smoke["runs"]
    assert run["status"] == "passed" and (tmp_path / run["log"]).resolve().parent == tmp_path, run
    assert Path(run["log"]).name == "rel.gguf.smoke-llama.cpp-quantkit-tiny-Q8_0.log", run
    assert sorted(p.name for p in rel.iterdir()) == before
    quantkit("run", "r.yaml", "--no-eval", "--no-smoke", cwd=tmp_path, check=True)
    quantkit("verify", "rel", cwd=tmp_path, check=True)
    assert tune.log_folder(rel / "rtn-w4g128") == tmp_path / "rel.rtn-w4g128.tune-logs"
    (tmp_path / "quantkit.json").write_text("a stray file above the release")  # moves nothing: it holds no release
    assert integrity.beside(rel / "gguf", "x.log") == tmp_path / "rel.gguf.x.log"
    assert integrity.beside(tmp_path / "elsewhere" / "art", "x.log") == tmp_path / "elsewhere" / "art.x.log"


def test_a_local_source_names_the_hub_id_it_came_from_in_the_model_card(tmp_path: Path) -> None:
    """A release is usually made from a local copy of a hub model: `model.base_model` gives the card the hub id the
    hub links (a local path there would link nowhere); an id that is not ORG/NAME is a recipe error, before any
    work."""
    recipe = f"model:\n  source: {TINY}\n  base_model: my-org/quantkit-tiny\noutput: one\nquantize:\n  method: rtn\n"
    (tmp_path / "one.yaml").write_text(recipe)
    quantkit("run", "one.yaml", "--no-eval", "--no-smoke", cwd=tmp_path, check=True)
    header = yaml.safe_load((tmp_path / "one" / "README.md").read_text().split("---")[1])
    assert header["base_model"] == "my-org/quantkit-tiny" and header["base_model_relation"] == "quantized"
    for bad in ("models/quantkit-tiny/x", "quantkit-tiny", "my org/x"):
        (tmp_path / "bad.yaml").write_text(recipe.replace("my-org/quantkit-tiny", bad).replace("one\n", "two\n"))
        proc = quantkit("run", "bad.yaml", "--dry-run", cwd=tmp_path)
        assert proc.returncode == 2 and "model.base_model" in proc.stderr and "is not a hub id" in proc.stderr, \
            (bad, proc.stderr[-1000:])
    assert not (tmp_path / "two").exists()


def test_a_gate_change_rechecks_the_recorded_figures_and_the_card_says_what_was_measured(tmp_path: Path) -> None:
    """Gates are limits on recorded figures: a re-run whose only change is a gate scores nothing again (no model
    loads), checks the recorded figures against the new limits, the tasks' recovery gates too (exit 3, naming each
    gate), and says so in report.md, tasks.md, report.json and the card; the card states the protocol and the gates
    its numbers were checked against, beside the build recipe that made the artifact (and its limits then)."""
    recipe = (f"model:\n  source: {TINY}\noutput: one\nquantize:\n  method: rtn\n"
              "evaluation:\n  dataset: heldout\n  ctx: 64\n  max_tokens: 64\n{gates}"
              "  tasks:\n    - {{task: quantkit_lastword, limit: 2{recovery}}}\nsmoke:\n  enabled: false\n")
    (tmp_path / "r.yaml").write_text(recipe.format(gates="", recovery=""))
    first = quantkit("run", "r.yaml", "--json", cwd=tmp_path, check=True)  # --json: the log goes to stderr
    assert "loading baseline in" in first.stderr, first.stderr[-2000:]
    card = (tmp_path / "one" / "README.md").read_text()
    assert "\n| None |" not in card and "\n| one | " in card, card  # the output's name, not a stored None
    assert "Protocol: 64 tokens of `heldout`" in card and "All gates pass." in card, card
    assert "Build recipe (what made this artifact" in card and "max_kld: 0.5" in card

    (tmp_path / "r.yaml").write_text(recipe.format(gates="  gates: {max_kld: 0.000001}\n",
                                                   recovery=", min_recovery: 10"))  # no recovery reaches 10
    proc = quantkit("run", "r.yaml", "--json", cwd=tmp_path)
    assert proc.returncode == 3 and "max_kld" in proc.stderr and "1e-06" in proc.stderr, proc.stderr[-2000:]
    assert "min_recovery quantkit_lastword acc" in proc.stderr, proc.stderr[-2000:]
    assert "evaluation reused (one)" in proc.stderr and "loading " not in proc.stderr, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["outputs"][0]["status"] == "reused" and report["failed_gates"], report
    gate = next(g for g in report["outputs"][0]["gates"] if g["gate"] == "max_kld")
    assert gate["limit"] == 0.000001 and gate["passed"] is False
    assert "max_kld: kld" in (tmp_path / "one" / "report.md").read_text() and \
        "(limit <= 1e-06) FAILED" in (tmp_path / "one" / "report.md").read_text()
    card = (tmp_path / "one" / "README.md").read_text()
    assert "**2 gate(s) failed.**" in card and "(limit <= 1e-06) FAIL" in card and "(limit >= 10) FAIL" in card, card
    assert "| FAIL (≥ 10) |" in (tmp_path / "one" / "tasks.md").read_text()
    assert "Build recipe (what made this artifact" in card and "max_kld: 0.5" in card  # the limit it was built under
    assert integrity.verify(tmp_path / "one").ok
