"""``quantkit run`` and its ``--dry-run`` on build-trt outputs, and what the plan says of each output's evaluation.

A build-trt artifact's ``hf/`` (ModelOpt's unified checkpoint) is what vLLM evaluates and serves: the kinds table
says so once (``Kind.reads``), and the run and its plan read that folder in vLLM; a ``none`` export's hf/, a plain
checkpoint, is scored where ``eval --engine auto`` scores one, in transformers (the plan foresees its kind).
ModelOpt's TensorRT-LLM-only exports (INT4-AWQ, W4A8-AWQ, INT8-SQ) are skipped naming TensorRT-LLM; where vLLM cannot
run (no vLLM, no GPU) the skip says that, in the engines registry's words. Never through transformers, which loads a
ModelOpt export silently wrong.
The builds are real (ModelOpt in .venv-trt, as tests/test_trt.py's); the plan's tests need no ModelOpt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from quantkit import integrity
from quantkit.engines import registry, smoke
from quantkit.errors import QuantkitError, UsageError
from quantkit.evaluation.evaluate import expand_targets
from quantkit.formats import kinds
from quantkit.formats.names import TRANSFORMERS, VLLM, KindName
from quantkit.manifest import read_manifest
from quantkit.producers.trt import QUANT_ALGO, pyenv

from conftest import ROOT, TINY, quantkit

pytestmark = pytest.mark.cli

VLLM_SERVED = ("fp8", "nvfp4", "w4a16_nvfp4")  # vLLM 0.26 loads these exports' hf/ (none's too: NONE_EXPORTS)
TRTLLM_ONLY = ("int8_sq", "int4_awq", "w4a8_awq")
# quantization none: ModelOpt writes hf_quant_config.json only where it records a quantization, of the weights or of
# the KV cache hf/ carries (FP8 only; an INT8 one stays in trtllm-ckpt/), so hf/ is a plain checkpoint unless an FP8
# KV cache is asked for: (name, kv_cache, the engine eval --engine auto picks for hf/).
NONE_EXPORTS = (("trt-none", "auto", TRANSFORMERS), ("none-kv-int8", "int8", TRANSFORMERS),
                ("none-kv-fp8", "fp8", VLLM))
# Why vLLM cannot run here, as the registry says it for every kind (None on a machine where it runs).
VLLM_WHY = registry.engine_unavailable(VLLM, None)


def _modelopt() -> str:
    try:
        pyenv.probe(None)
    except QuantkitError as e:
        return e.message
    return ""


MODELOPT_MISSING = _modelopt()
needs_modelopt = pytest.mark.skipif(bool(MODELOPT_MISSING), reason=f"no ModelOpt environment ({MODELOPT_MISSING}); "
                                    "`make install` builds .venv-trt")


def _recipe(work: Path, outputs: list[dict], evaluation: dict | None = None) -> Path:
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"source": str(TINY)}, "output": "release", "outputs": outputs,
        "calibration": {"dataset": "mixed", "samples": 8, "seq_len": 128},
        "evaluation": evaluation or {"dataset": "heldout", "max_tokens": 2048}}))
    return path


def _plan(work: Path, *flags: str) -> dict:
    proc = quantkit("run", "recipe.yaml", "--dry-run", "--json", *flags, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {Path(o["path"]).name: o for o in json.loads(proc.stdout)["outputs"]}


def test_the_kinds_table_says_which_folder_of_a_trt_artifact_the_engines_read(tmp_path: Path) -> None:
    """One rule (the kind's row): vLLM evaluates and serves a build-trt artifact's hf/. ``eval`` and ``smoke``,
    given the artifact itself, refuse it naming the folder to give them (eval said only 'not a checkpoint')."""
    art = tmp_path / "trt-fp8"
    (art / "trtllm-ckpt").mkdir(parents=True)
    kind = kinds.detect(art)
    assert kind.name == KindName.TENSORRT_LLM and (kind.evaluate, kind.serve) == (VLLM, VLLM)
    assert kind.folder(art) == art / "hf"
    assert kinds.BY_NAME[KindName.COMPRESSED_TENSORS].folder(art) == art
    with pytest.raises(UsageError) as e:
        registry.evaluating_engine(art)
    assert e.value.hint == f"evaluate its hf/ folder: quantkit eval {art / 'hf'}"
    with pytest.raises(UsageError) as e:
        registry.serving_engine(art)
    assert e.value.hint == f"serve its hf/ folder: quantkit smoke {art / 'hf'} --engine vllm"
    with pytest.raises(UsageError) as e:  # eval's own check of what it is given says the same
        expand_targets([art], "auto")
    assert e.value.hint == f"evaluate its hf/ folder: quantkit eval {art / 'hf'}"


def test_tune_given_a_trt_artifact_itself_names_its_hf_folder(tmp_path: Path) -> None:
    """``quantkit tune OUT`` of a build-trt artifact is refused naming ``OUT/hf``, as ``eval`` and ``smoke`` refuse it:
    vLLM serves hf/, whose sweep is recorded in OUT's manifest. The artifact's row says vLLM serves it, so tune let it
    through, and the sweep died reading OUT/config.json (a ValueError and its traceback) before vLLM started."""
    from quantkit.engines.vllm import tune

    art = tmp_path / "trt-fp8"
    (art / "trtllm-ckpt").mkdir(parents=True)
    with pytest.raises(UsageError) as e:
        tune.run(art, tune.TuneOptions(python=str(ROOT / "no-such-python")))
    assert e.value.hint == f"measure its hf/ folder: quantkit tune {art / 'hf'}", (e.value.message, e.value.hint)


def test_the_plan_evaluates_and_smokes_hf_in_vllm_or_names_tensorrt_llm(tmp_path: Path) -> None:
    """Before anything is built, the plan of each build-trt quantization: vLLM reads hf/ where it loads the export
    (here without vLLM: skipped, saying so); a TensorRT-LLM-only export is skipped naming its ModelOpt format and
    TensorRT-LLM, whatever is installed. It used to skip them all with 'cannot be evaluated as it is'."""
    _recipe(tmp_path, [{"method": "trt", "quantization": q} for q in QUANT_ALGO])
    planned = _plan(tmp_path)
    for q in VLLM_SERVED:
        o = planned[f"trt-{q}"]
        for step in (o["evaluate"], o["smoke"]):
            assert step.startswith("vllm on hf/"), (q, step)
            assert "TensorRT-LLM" not in step
            if VLLM_WHY:
                assert step == f"vllm on hf/: skipped ({VLLM_WHY})", (q, step)
    for q in TRTLLM_ONLY:
        o = planned[f"trt-{q}"]
        why = f"{q} exports ModelOpt {QUANT_ALGO[q]}, a TensorRT-LLM format vLLM"
        for step in (o["evaluate"], o["smoke"]):
            assert step.startswith(f"vllm on hf/: skipped ({why}") and "TensorRT-LLM serves it" in step, (q, step)


def _none_outputs() -> list[dict]:
    return [{"method": "trt", "quantization": "none", **({"kv_cache": kv, "name": name} if kv != "auto" else {})}
            for name, kv, _ in NONE_EXPORTS]


def test_the_plan_evaluates_a_trt_none_export_in_the_engine_the_run_picks(tmp_path: Path) -> None:
    """A build-trt ``none`` output's hf/ is a plain Hugging Face checkpoint (with an FP8 KV cache, a ModelOpt export),
    which the run scores where ``eval --engine auto`` scores hf/: transformers. The plan said vLLM for every build-trt
    output. Now it foresees hf/'s kind from the spec and names that kind's engine; the smoke test serves hf/ in vLLM
    either way."""
    _recipe(tmp_path, _none_outputs())
    planned = _plan(tmp_path)
    for name, _, engine in NONE_EXPORTS:
        o = planned[name]
        if engine == TRANSFORMERS:  # a CPU engine: never skipped for a missing GPU
            assert o["evaluate"] == "transformers on hf/, heldout, ctx 2048, at most 2,048 tokens", (name, o)
        else:
            assert o["evaluate"].startswith("vllm on hf/"), (name, o["evaluate"])
        assert o["smoke"].startswith("vllm on hf/"), (name, o["smoke"])


def test_the_plan_foresees_transformers_refusing_a_modelopt_hf_as_the_run_does(tmp_path: Path) -> None:
    """A recipe that names ``evaluation.engine: transformers``: the run asks transformers' own check of hf/, which
    refuses a ModelOpt export (it would load the quantized weights as plain ones) and records the evaluation as
    skipped; the plan said "transformers on hf/" for every build-trt output. It now foresees hf/'s kind and asks the
    same check, in the same words: skipped for fp8 and for none with an FP8 KV cache, scored for a plain none."""
    from quantkit.engines.transformers import logits as hf_logits

    outputs = [{"method": "trt", "quantization": "fp8"}, *_none_outputs()]
    _recipe(tmp_path, outputs, {"dataset": "heldout", "max_tokens": 2048, "engine": TRANSFORMERS})
    planned = _plan(tmp_path)
    for name in ("trt-fp8", "none-kv-fp8"):
        hf = Path(planned[name]["path"]) / "hf"  # as the plan and the run name it (the recipe's output, relative)
        with pytest.raises(UsageError) as e:  # the run's words for the folder it will find
            hf_logits.refuse(hf, kinds.BY_NAME[KindName.MODELOPT])
        assert planned[name]["evaluate"] == f"transformers on hf/: skipped ({e.value.message})", planned[name]
    for name in ("trt-none", "none-kv-int8"):
        o = planned[name]
        assert o["evaluate"] == "transformers on hf/, heldout, ctx 2048, at most 2,048 tokens", o


def test_the_recipes_smoke_engine_is_the_one_run_serves_with(tmp_path: Path) -> None:
    """``smoke.engine`` in a recipe was accepted and ignored: run served every output in its kind's engine. Now the
    named engine serves it, and an engine the recipe names is never skipped for its absence (the smoke test fails,
    loudly, where it is missing), as an automatic pick is."""
    outputs = [{"method": "fp8", "scheme": "dynamic"}]
    for smoke_spec, expected in (({"engine": "sglang"}, "sglang"), ({}, "vllm")):
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({
            "model": {"source": str(TINY)}, "output": "release", "outputs": outputs,
            "evaluation": {"enabled": False}, "smoke": smoke_spec}))
        step = _plan(tmp_path)["fp8-dynamic"]["smoke"]
        if smoke_spec or not VLLM_WHY:
            assert step.startswith(expected) and "skipped" not in step, step
        else:  # vLLM picked, and missing here: the skip in the registry's words
            assert step == f"skipped ({VLLM_WHY})", step


def test_the_plan_shows_the_tasks_the_max_tokens_and_what_a_gguf_output_skips(tmp_path: Path) -> None:
    """The demo recipe's evaluation (two lm-eval tasks, max_tokens) on one llm-compressor and one GGUF output: the
    plan names the tasks under the table, the GGUF output's note says which it will not score and why, and the
    evaluate column says the token budget."""
    demo = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    _recipe(tmp_path, [{"method": "rtn"}, {"method": "gguf", "types": ["Q8_0"]}], demo["evaluation"])
    proc = quantkit("run", "recipe.yaml", "--dry-run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["notes"] == ["lm-eval tasks, scored on each output evaluated: quantkit_nextsentence (multiple_choice, "
                             "limit 50); quantkit_lastword_gen (generate_until, limit 50)"]
    outs = {Path(o["path"]).name: o for o in plan["outputs"]}
    assert "tasks not scored: quantkit_nextsentence (llama-server gives no prompt log-probabilities)" in \
        outs["gguf"]["notes"]
    assert not any("tasks" in n for n in outs["rtn-w4g128"]["notes"])
    for o in outs.values():
        assert o["evaluate"].endswith("heldout, ctx 2048, at most 16,384 tokens"), o["evaluate"]
    table = quantkit("run", "recipe.yaml", "--dry-run", cwd=tmp_path).stdout
    assert plan["notes"][0] in " ".join(table.split())  # the line under the table, as the JSON says it


def test_the_plan_says_its_disk_figure_is_the_free_space_needed(tmp_path: Path) -> None:
    """The disk column is what must be free while an output is made (the free-space check's figure: a GGUF
    output's counts its 16-bit intermediate), and the plan says so rather than calling it the size."""
    _recipe(tmp_path, [{"method": "gguf", "types": ["Q8_0"]}])
    table = " ".join(quantkit("run", "recipe.yaml", "--dry-run", "--no-eval", cwd=tmp_path).stdout.split())
    assert "free disk" in table and "what must be free while it is made" in table, table
    assert "not the artifact's size" in table


@needs_modelopt
@pytest.mark.slow
def test_run_reads_a_trt_artifacts_hf_in_vllm_and_records_why_where_it_cannot(tmp_path: Path) -> None:
    """``quantkit run`` of a trt-fp8 and a trt-int4_awq output (ModelOpt builds them for real): the evaluation, the
    recipe's task and the smoke test of each read hf/ in vLLM, recorded in report.json and the artifact's manifest.
    Here (no vLLM) fp8's say vLLM is missing; int4_awq's name its format and TensorRT-LLM, vLLM or not. The plan of
    the same release says what the run recorded. Given hf/, ``eval`` records into the artifact (its manifest) and
    ``smoke`` logs beside it, not inside it."""
    _recipe(tmp_path, [{"method": "trt", "quantization": "fp8", "kv_cache": "fp8"},
                       {"method": "trt", "quantization": "int4_awq"}],
            {"dataset": "heldout", "max_tokens": 2048, "tasks": [{"task": "quantkit_lastword_gen", "limit": 4}]})
    proc = quantkit("run", "recipe.yaml", "--json", cwd=tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = {o["name"]: o for o in json.loads(proc.stdout)["outputs"]}
    fp8, int4 = outs["trt-fp8"], outs["trt-int4_awq"]
    for o in (fp8, int4):
        assert o["status"] == "built" and o["evaluation"]["engine"] == o["smoke"]["engine"] == VLLM
        record = read_manifest(tmp_path / o["path"]).pipeline
        assert record is not None and (record.evaluation, record.smoke) == (o["evaluation"], o["smoke"])
    if VLLM_WHY:
        for step in (fp8["evaluation"], fp8["smoke"]):
            assert step["status"] == "skipped" and step["summary"] == VLLM_WHY
        assert fp8["evaluation"]["tasks_skipped"]["why"] == VLLM_WHY
    else:
        assert fp8["evaluation"]["results"] and fp8["smoke"]["status"] == "passed"
    for step in (int4["evaluation"], int4["smoke"]):
        assert step["status"] == "skipped", step
        assert "ModelOpt W4A16_AWQ export" in step["summary"] and "TensorRT-LLM serves it" in step["summary"]
    planned = _plan(tmp_path)
    assert planned["trt-int4_awq"]["action"] == "reuse"
    assert planned["trt-int4_awq"]["evaluate"] == f"vllm on hf/: skipped ({int4['evaluation']['summary']})"
    if VLLM_WHY:
        assert planned["trt-fp8"]["smoke"] == f"vllm on hf/: skipped ({VLLM_WHY})"

    art = tmp_path / fp8["path"]
    (target,) = expand_targets([art / "hf"], VLLM)
    assert target.manifest_dir is not None and target.manifest_dir.resolve() == art.resolve()
    assert target.label == "trt-fp8/hf"
    # beside the release, not in it, where SHA256SUMS would not list it
    assert smoke.log_path(art / "hf", VLLM, art / "hf", None) == \
        art.parent.parent / f"{art.parent.name}.trt-fp8.smoke-vllm.log"
    assert integrity.verify(art).ok


@needs_modelopt
@pytest.mark.slow
def test_a_kernel_sweep_of_hf_is_recorded_in_the_trt_artifact_and_its_card(tmp_path: Path) -> None:
    """``smoke.tune_kernels`` sweeps a build-trt output's hf/ (what vLLM serves), and the sweep's record (table,
    choice, ``vllm serve`` command) goes into the artifact's own manifest, as eval's and smoke's of hf/ do: it was
    recorded only in a folder holding a manifest itself, so hf/'s went nowhere and the card never showed it. The
    sweep needs a GPU; its result here is one the product's own types make (vLLM's default measured on hf/), recorded
    as ``tune`` records it. Its logs go beside the release holding the artifact, not into either."""
    from quantkit.engines.vllm import kernel_sweep, kernels, tune
    from quantkit.engines.vllm.kernels import LogFacts, Measurement

    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({
        "model": {"source": str(TINY)}, "output": "release", "outputs": [{"method": "trt", "quantization": "fp8"}],
        "calibration": {"dataset": "mixed", "samples": 8, "seq_len": 128},
        "evaluation": {"enabled": False}, "smoke": {"enabled": False}}))
    quantkit("run", "recipe.yaml", cwd=tmp_path, timeout=1800, check=True)
    art = tmp_path / "release" / "trt-fp8"
    hf = art / "hf"
    q = kernels.read_quantization(hf)
    default = next(c for c in kernels.configurations(q) if c.kind == "default")
    measured = Measurement(default, "ok", LogFacts("modelopt"), 0.05, {"1": 180.0, "16": 2400.0})
    choice = kernels.choose([measured])
    assert choice is not None
    command = kernels.serve_command(str(hf), choice.configuration, ["--quantization", "modelopt"])
    result = kernel_sweep.SweepResult(str(hf), q, [], [], kernel_sweep.Bench(engine_args={"quantization": "modelopt"}),
                                      [measured], choice, command)

    assert tune.save(hf, result) == art
    serving = read_manifest(art).serving
    assert serving is not None and serving.command == command.to_json() and serving.table == result.markdown()
    assert integrity.verify(art).ok
    assert tune.log_folder(hf) == tmp_path / "release.trt-fp8.tune-logs"

    proc = quantkit("run", "recipe.yaml", "--json", cwd=tmp_path, check=True)  # reused: the card written again
    assert [o["status"] for o in json.loads(proc.stdout)["outputs"]] == ["reused"]
    card = (art / "README.md").read_text()
    assert "## Serving in vLLM" in card and "vllm serve hf --quantization modelopt" in card, card
    assert result.markdown().rstrip() in card


@needs_modelopt
@pytest.mark.slow
def test_a_trt_none_export_is_scored_in_the_engine_its_plan_named(tmp_path: Path) -> None:
    """ModelOpt builds the none exports for real: the engine the plan named before anything was built (foreseen from
    each spec) is the one the run scored hf/ in (found from the folder), transformers where hf/ is a plain
    checkpoint, vLLM (skipped where it cannot run) where an FP8 KV cache makes it a ModelOpt export."""
    _recipe(tmp_path, _none_outputs())
    planned = _plan(tmp_path)
    proc = quantkit("run", "recipe.yaml", "--json", "--no-smoke", cwd=tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = {o["name"]: o for o in json.loads(proc.stdout)["outputs"]}
    for name, _, engine in NONE_EXPORTS:
        ev = outs[name]["evaluation"]
        scored = ev["engine"] if ev.get("status") == "skipped" else ev["results"][0]["engine"]["engine"]
        assert scored == engine, (name, ev)
        assert planned[name]["evaluate"].startswith(f"{engine} on hf/"), (name, planned[name])
        if engine == TRANSFORMERS:  # a CPU engine: scored here
            assert ev.get("status") != "skipped" and ev["results"], (name, ev)
