"""scripts/gpu_cases.py without a GPU: the case file and its validation, the engines' Pythons, the plan (--dry-run),
the checks against the H200 results kept in bench/results/h200/, the table, the scheduling gate, and a stopped run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from quantkit.engines.vllm import kernels

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "bench" / "results" / "h200"
SCRIPT = ROOT / "scripts" / "gpu_cases.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_case_file as cf  # noqa: E402
import gpu_case_report as cr  # noqa: E402
import gpu_cases as gc  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def cases() -> list:
    return cf.load_cases(cf.CASES)


def by_name(cases: list) -> dict:
    return {c.name: c for c in cases}


def opts(*argv: str):
    return gc.parse_args(list(argv))


def paths(tmp: Path, *argv: str) -> object:
    return gc.Paths.of(opts("--out", str(tmp), "--vllm-python", sys.executable, *argv))


# ------------------------------------------------------------------------------------------------------------------
# The shipped case file


def test_shipped_cases_load(cases: list) -> None:
    c = by_name(cases)
    assert len(c) == len(cases) and all(x.expect.kernel for x in cases if x.expect.loads)  # a refused load has none
    assert not c["vlm-llava-awq"].expect.loads and c["vlm-llava-awq"].model == "vlm:llava"
    assert c["awq-legacy"].produce.serve == "autoawq" and c["modelopt-fp8"].produce.serve == "hf"
    assert c["awq-w4g128"].load.batches == [1, 16] and c["awq-w4g128"].load.enforce_eager  # from defaults
    assert c["rtn-w4g128-8b"].sweep.prompt_len == 512 and not c["rtn-w4g128-8b"].sweep.enforce_eager
    assert c["gptq-w4g128"].expect.kernel == "MacheteLinearKernel for CompressedTensorsWNA16"  # YAML merge key
    assert c["fp8-block-sweep"].artifact == "fp8-block"  # the same command: one artifact


def test_two_gpu_case_needs_two_gpus(cases: list, tmp_path: Path) -> None:
    """The tensor-parallel case is data like the others: on a machine with fewer than two GPUs it is skipped with
    its reason, never run on one GPU and never silently dropped."""
    c = by_name(cases)["gptq-w4g128-x2"]
    assert c.needs == ["gpus2"] and c.load.engine_args == {"tensor_parallel_size": 2}
    assert c.produce.args == ["--num-gpus", "2"] and c.smoke.args[:2] == ["--tp", "2"]
    reason = gc.missing_needs(c, paths(tmp_path))
    assert (reason is None) == (len(gc.gpus()) >= 2)
    if reason:
        assert "needs two GPUs" in reason


def test_the_old_scripts_are_covered(cases: list) -> None:
    """Every artifact of the reference model's H200 matrix (bench/results/h200/vllm_matrix.json), the two it served
with smoke (gpu_smoke.json), and ModelOpt's checkpoint-only export of the reference model and the 8B shape."""
    produced = {(c.model, c.produce.verb, tuple(c.produce.args)) for c in cases}
    tiny = "models/quantkit-tiny"
    for verb, args in [("rtn", ()), ("awq", ()), ("gptq", ()), ("gptq", ("--bits", "8")), ("fp8", ()),
                       ("fp8", ("--scheme", "dynamic")), ("fp8", ("--scheme", "block")), ("int8", ()),
                       ("awq", ("--format", "autoawq")), ("gptq", ("--format", "gptq"))]:
        assert (tiny, verb, args) in produced, (verb, args)
    c = by_name(cases)
    assert c["awq-w4g128"].smoke is not None and c["fp8-static"].smoke is not None
    for name in ("modelopt-fp8", "modelopt-fp8-8b"):
        assert c[name].produce.verb == "build-trt" and "--checkpoint-only" in c[name].produce.args
        assert c[name].smoke is not None and c[name].eval is not None and c[name].needs == ["trt"]
    assert c["modelopt-fp8-8b"].model == "shape:8b"


def test_moe_cases(cases: list) -> None:
    """One case per compressed-tensors method of the MoE reference model, each served, a few scored by both engines,
    all waiting for the model while it is being trained."""
    moe = cf.select(cases, ["moe"], [])
    produced = {(c.produce.verb, tuple(c.produce.args)) for c in moe}
    assert produced == {("rtn", ()), ("awq", ()), ("gptq", ()), ("fp8", ()), ("fp8", ("--scheme", "dynamic")),
                        ("fp8", ("--scheme", "block")), ("int8", ())}
    assert all(c.model == "models/quantkit-tiny-moe" and c.smoke is not None and c.expect.smoke for c in moe)
    assert all(c.expect.moe_method and c.expect.kernel for c in moe)
    scored = {c.name for c in moe if c.eval}
    assert scored == {"moe-gptq-w4g128", "moe-fp8-static", "moe-int8-sq"}
    assert all(by_name(cases)[n].eval.engines == ["vllm", "transformers"] for n in scored)
    if not (ROOT / "models" / "quantkit-tiny-moe" / "config.json").is_file():
        assert all(c.pending for c in moe)
    assert by_name(cases)["rtn-w4g128"].pending is None and by_name(cases)["rtn-w4g128"].eval is None


def test_selection(cases: list) -> None:
    assert "fp8-block-sweep" not in [c.name for c in cf.select(cases, [], [])]  # optional
    assert [c.name for c in cf.select(cases, ["8b"], ["modelopt"])] == ["rtn-w4g128-8b"]
    assert [c.name for c in cf.select(cases, ["fp8-block-sweep"], [])] == ["fp8-block-sweep"]
    with pytest.raises(cf.CaseError, match="no case has that name or tag"):
        cf.select(cases, ["nosuch"], [])


# ------------------------------------------------------------------------------------------------------------------
# A bad case file is one line naming file, line and field


BASE = "cases:\n  - name: a\n    produce: {verb: rtn}\n"


@pytest.mark.parametrize("text, message", [
    (BASE + "    expect: {kernal: Machete}\n", ":4: cases[0].expect.kernal: unknown key; expected one of loads"),
    (BASE + "    load: {batches: [1, x]}\n", ":4: cases[0].load.batches: expected a non-empty list of positive"),
    (BASE + "  - name: a\n    produce: {verb: awq}\n", ":4: cases[1].name: 'a' is also the name of cases[0]"),
    (BASE + "    expect: {kernel: '/Machete(/'}\n", "cases[0].expect.kernel: not a valid regular expression"),
    ("cases:\n  - name: t\n    produce: {verb: build-trt}\n", ":3: cases[0].produce: build-trt needs a recipe"),
    ("cases:\n  - name: t\n    produce: {verb: rtn, recipe: recipes/rtn.yaml}\n", "only build-trt takes a recipe"),
    (BASE + "    expect: {min_tok_s: {4: 10}}\n", "cases[0].expect.min_tok_s: batch 4 is not measured"),
    (BASE + "    expect: {max_kld: 0.1}\n", "cases[0].expect.max_kld: needs an eval: section with the vllm engine"),
    (BASE + "    eval: {engines: [transformers]}\n    expect: {min_top1: 0.9}\n",
     "cases[0].expect.min_top1: needs an eval: section with the vllm engine"),
    (BASE + "    eval: {}\n    expect: {max_engine_ppl_diff: 0.01}\n",
     ":5: cases[0].expect.max_engine_ppl_diff: needs eval: {engines: [vllm, transformers]}"),
    (BASE + "    eval: {engines: [vllm, llamacpp]}\n",
     ":4: cases[0].eval.engines: expected a list of distinct engines"),
    (BASE + "    expect: {moe_method: '/Marlin(/'}\n", "cases[0].expect.moe_method: not a valid regular expression"),
    ("pending_models: [models/x]\n" + BASE, ":1: pending_models: expected a mapping of model folder to why"),
    ("pending_models: {models/x: soon}\n" + BASE + "    model: models/y\n",
     "no checkpoint (config.json) at models/y (a model still to come goes under pending_models)"),
    (BASE + "    model: shape:9b\n", ":4: cases[0].model: unknown shape '9b'"),
    (BASE + "    model: models/nothing\n", "no checkpoint (config.json) at models/nothing"),
    (BASE + "    produce: {verb: quantize}\n", "cases[0].produce.verb: expected one of awq, gptq"),
    ("cases:\n  - name: x\n", ":2: cases[0]: needs produce"),
    ("cases: [\n", ": not valid YAML"),
    ("- just\n- a list\n", ": expected a mapping with a non-empty list under 'cases:'"),
    (BASE + "    gpu_memory_utilization: 1.5\n", "expected a fraction in (0, 1); got 1.5"),
    ("defaults: {colour: red}\n" + BASE, ":1: defaults.colour: unknown key"),
])
def test_bad_case_files(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "cases.yaml"
    f.write_text(text)
    with pytest.raises(cf.CaseError) as e:
        cf.load_cases(f)
    assert message in str(e.value) and str(e.value).startswith(str(f)) and "\n" not in str(e.value)


def test_bad_case_file_through_the_script(tmp_path: Path) -> None:
    f = tmp_path / "cases.yaml"
    f.write_text(BASE + "    smoke: {retries: 3}\n")
    p = subprocess.run([sys.executable, str(SCRIPT), "--cases", str(f), "--dry-run"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == f"error: {f}:4: cases[0].smoke.retries: unknown key; expected one of args, timeout\n"


def test_a_python_without_quantkits_dependencies_is_told_which_to_use() -> None:
    """A Python without pydantic (which quantkit, imported by the runner, needs): one line naming the Python to run
    it with, exit 2, no traceback."""
    code = ("import runpy, sys; sys.modules['pydantic'] = None; sys.argv = [sys.argv[1], '--dry-run']; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert "no module 'pydantic'" in p.stderr and ".venv/bin/python scripts/gpu_cases.py" in p.stderr
    assert "python scripts/gpu_cases.py --out OUT" in (gc.__doc__ or "")


# ------------------------------------------------------------------------------------------------------------------
# The engines' Pythons


def test_engine_pythons_follow_quantkits_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag first, then the engine's variable of quantkit's registry (QUANTKIT_VLLM_PYTHON, QUANTKIT_TRT_PYTHON
    for ModelOpt): the runner finds engines as quantkit does, and its results say which rule chose each."""
    monkeypatch.setenv("QUANTKIT_VLLM_PYTHON", "/opt/vllm-env/bin/python")
    monkeypatch.setenv("QUANTKIT_TRT_PYTHON", "/opt/modelopt-env/bin/python")
    p = gc.Paths.of(opts("--out", str(tmp_path)))
    assert (p.vllm.python, p.vllm.origin) == ("/opt/vllm-env/bin/python", "QUANTKIT_VLLM_PYTHON")
    assert (p.modelopt.python, p.modelopt.origin) == ("/opt/modelopt-env/bin/python", "QUANTKIT_TRT_PYTHON")
    p = paths(tmp_path, "--modelopt-python", "/usr/bin/python3")
    assert (p.vllm.python, p.vllm.origin) == (sys.executable, "--vllm-python")
    assert (p.modelopt.python, p.modelopt.origin) == ("/usr/bin/python3", "--modelopt-python")


def test_an_engine_python_gets_its_own_paths_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python quantkit's --python flags are given for vLLM: its --vllm-path folders on PYTHONPATH and nothing of
    the runner's (llm-compressor's pins must not shadow vLLM's), its variables set; ModelOpt's without paths gets no
    PYTHONPATH at all. Each is a real interpreter that the probe finds packages in."""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "llmc-site"))
    site = tmp_path / "vllm-site"
    (site / "fake_engine").mkdir(parents=True)
    (site / "fake_engine" / "__init__.py").write_text("")
    p = paths(tmp_path, "--vllm-path", str(site), "--modelopt-python", sys.executable)
    p.write_wrappers()
    code = "import os, sys; print(os.environ.get('PYTHONPATH'), os.environ.get('VLLM_NO_USAGE_STATS'), sys.executable)"
    for name, expected in ((gc.VLLM, f"{site} 1"), ("modelopt", "None None")):
        out = subprocess.run([str(p.wrapper(name)), "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.split()[:2] == expected.split() and Path(out.split()[2]).name.startswith("python"), name
    assert p.vllm.has("fake_engine") and not p.modelopt.has("fake_engine") and not p.vllm.has("no_such_module")


def test_an_engine_that_is_not_installed_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """Before any case starts: exit 2 and the flags and variable that would name vLLM's Python."""
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--only", "rtn-w4g128", "--vllm-python",
                        sys.executable, "--vllm-path", str(tmp_path / "empty")], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"error: vLLM is not installed in {sys.executable} (--vllm-python), PYTHONPATH=") and \
        p.stderr.endswith(": pass --vllm-python or --vllm-path, or set QUANTKIT_VLLM_PYTHON\n")
    assert not (tmp_path / "results.json").exists()


# ------------------------------------------------------------------------------------------------------------------
# The plan


def test_dry_run_prints_every_command(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--only", "tiny",
                        "--vllm-python", "/opt/v/python", "--vllm-path", "/opt/v"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert f"vllm: /opt/v/python (--vllm-python), PYTHONPATH=/opt/v, run as {tmp_path}/bin/vllm-python" in out
    assert f"produce (build): {sys.executable} -m quantkit gptq {ROOT}/models/quantkit-tiny " \
           f"{tmp_path}/arts/gptq-w8g128 --force --json --bits 8" in out
    assert f"smoke:   {sys.executable} -m quantkit smoke {tmp_path}/arts/awq-legacy/autoawq --engine vllm" in out
    assert "QUANTKIT_VLLM_ARGS='{\"gpu_memory_utilization\": 0.12, \"quantization\": \"modelopt\", " \
           "\"kv_cache_memory_bytes\": 4294967296}'" in out
    assert "--gpu-memory-utilization 0.12 --server-arg=--kv-cache-memory-bytes=4294967296 " \
           "--server-arg=--quantization=modelopt" in out
    # parallel loads get a fixed KV cache (no memory profiling); --parallel 1 lets vLLM size it
    assert '"enforce_eager": true, "kv_cache_memory_bytes": 4294967296}' in out
    assert f"build-trt {tmp_path}/recipes/modelopt-fp8.yaml --force --json --python {tmp_path}/bin/modelopt-python " \
           "--checkpoint-only" in out
    assert f"output: {tmp_path}/arts/modelopt-fp8" in out and "rtn-w4g128-8b" not in out
    assert not (tmp_path / "results.json").exists()  # nothing ran


def test_dry_run_of_the_moe_cases(tmp_path: Path) -> None:
    """Both eval engines of a case, each with its own report folder; a model still to come is named as the reason
    the case would be skipped."""
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--only", "moe-fp8-static"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert f"quantkit eval {tmp_path}/arts/moe-fp8-static --engine vllm --python {tmp_path}/bin/vllm-python" in p.stdout
    assert f"quantkit eval {tmp_path}/arts/moe-fp8-static --engine transformers --device cuda --baseline " \
           f"{ROOT}/models/quantkit-tiny-moe --dataset heldout --ctx 2048 --max-tokens 32768 --report-dir " \
           f"{tmp_path}/logs/moe-fp8-static/eval-transformers --json" in p.stdout
    assert "moe method~'CompressedTensorsW8A8Fp8MoEMethod'" in p.stdout and "moe~'VLLM_CUTLASS'" in p.stdout
    if not (ROOT / "models" / "quantkit-tiny-moe" / "config.json").is_file():
        assert "skipped on this machine: models/quantkit-tiny-moe is not there yet: the MoE reference model" in p.stdout


def test_a_pending_model_skips_its_cases(tmp_path: Path) -> None:
    """Until the model is there its cases are skipped with the reason, nothing is started; once it is, they run."""
    f = tmp_path / "cases.yaml"
    f.write_text("pending_models: {models/later: being trained}\ncases:\n  - name: m\n    model: models/later\n"
                 "    produce: {verb: rtn}\n    expect: {kernel: Machete}\n")
    cases = cf.load_cases(f)
    p = paths(tmp_path)
    gc.Run(cases, p, opts("--out", str(tmp_path)), {}).run()
    r = json.loads((tmp_path / "results.json").read_text())["cases"][0]
    assert r["status"] == "skipped" and r["reason"] == "models/later is not there yet: being trained"
    assert not (tmp_path / "logs").exists()
    other = cf.load_cases(f)[0]
    other.model = "models/quantkit-tiny"  # a model that is there: pending no longer applies
    assert gc.missing_needs(other, p) is None


def test_a_case_whose_recipe_scores_tasks_needs_lm_eval(tmp_path: Path, cases: list) -> None:
    """A run whose recipe scores lm-eval tasks is skipped, with quantkit's own missing-backend line, where quantkit's
    Python has no lm-eval: before anything starts, not a second into the case as run-trt-fp8 failed on its first GPU
    machine. The Python without it is this one without site-packages (-S), a real interpreter, not a stub."""
    f = tmp_path / "cases.yaml"
    f.write_text("cases:\n  - name: t\n    model: models/quantkit-tiny\n    produce:\n      verb: run\n"
                 "      recipe: {quantize: {method: rtn}, evaluation: {tasks: [{task: quantkit_lastword, limit: 5}]}}\n"
                 "    expect: {kernel: Machete}\n")
    case = cf.load_cases(f)[0]
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    (tmp_path / "out").mkdir()
    p = paths(tmp_path / "out")
    assert gc.scores_tasks(case, p) and gc.scores_tasks(by_name(cases)["run-trt-fp8"], p)
    assert not gc.scores_tasks(by_name(cases)["awq-w4g128"], p)  # a verb's case: no recipe, no tasks
    assert gc.missing_needs(case, p) is None  # this Python has lm-eval (make install)
    p.python = str(bare)
    gc.Run([case], p, opts("--out", str(tmp_path / "out")), {}).run()
    r = json.loads((tmp_path / "out" / "results.json").read_text())["cases"][0]
    assert r["status"] == "skipped", r
    assert r["reason"].startswith("its recipe has evaluation tasks: scoring lm-eval tasks needs the Python package "
                                  "'lm_eval', which is not installed in " + str(bare)), r["reason"]
    assert r["reason"].endswith("(pip install 'quantkit[tasks]')") and not (tmp_path / "out" / "logs").exists()


def test_plan_lists_sweep_configurations_of_a_built_artifact(tmp_path: Path, cases: list) -> None:
    """With the artifact in place, the plan names each kernel configuration the sweep will start."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    p = paths(tmp_path)
    case = by_name(cases)["rtn-w4g128-8b"]
    art = p.served(case)
    art.mkdir(parents=True)
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W4A16", ["Linear"])},
                            quant_method="compressed-tensors", format="pack-quantized")
    (art / "config.json").write_text(json.dumps({"quantization_config": qc.model_dump(mode="json")}))
    text = gc.plan([case], p, opts())
    assert "MarlinLinearKernel: VLLM_DISABLED_KERNELS=MacheteLinearKernel; expects MarlinLinearKernel for " \
           "CompressedTensorsWNA16" in text
    assert "default: no flags; expects MacheteLinearKernel for CompressedTensorsWNA16" in text
    assert "produce (build)" in text  # no stamp: it would be produced again


def test_reuse_needs_the_same_command(tmp_path: Path, cases: list) -> None:
    p = paths(tmp_path)
    case = by_name(cases)["fp8-static"]
    art = p.artifact(case)
    art.mkdir(parents=True)
    (art / "config.json").write_text("{}")
    (art / "quantkit.json").write_text("{}")
    (p.arts / "fp8-static.stamp.json").write_text(json.dumps(gc.stamp(case, p)))
    assert gc.reusable(case, p)
    other = by_name(cases)["fp8-dynamic"]
    other.artifact = "fp8-static"  # same folder, another command
    assert not gc.reusable(other, p)


# ------------------------------------------------------------------------------------------------------------------
# Checks against the H200 results


MATRIX_CASE = {"awq-w4g128": "awq-w4g128", "gptq-w4g128": "gptq-w4g128", "gptq-w8g128": "gptq-w8g128",
               "rtn-w4g128": "rtn-w4g128", "fp8-static": "fp8-static", "fp8-dynamic": "fp8-dynamic",
               "fp8-block": "fp8-block", "int8-sq": "int8-sq", "autoawq": "awq-legacy", "gptq": "gptq-legacy"}


def h200_outcomes() -> dict[str, dict]:
    """The last H200 runs (vLLM matrix, smoke, eval) as the runner's outcome dicts."""
    out: dict[str, dict] = {}
    for row in json.loads((H200 / "vllm_matrix.json").read_text()):
        log = "\n".join(row["kernels"]) + f"\nquantization={row['quantization']}"
        facts = kernels.log_facts(log)
        out[MATRIX_CASE[row["artifact"]]] = {"load": {
            "status": "ok" if row["loads"] else "failed", "facts": facts.to_json(),
            "decode_tok_s": {"1": row["tok_s_b1"], "16": row["tok_s_b16"]}, "extra": {"vllm": "0.26.0"}}}
    for row in json.loads((H200 / "gpu_smoke.json").read_text()):
        out[row["artifact"].split("/")[-1]]["smoke"] = {
            "status": {"yes": "passed"}.get(row["loads"], "failed"), "decode_tok_s": row["tokens_per_s"],
            "doctor_ok": row["doctor_predicted"] == "loads", "doctor": row["doctor"]}
    for r in json.loads((H200 / "eval_vllm_tiny.json").read_text())["results"]:
        out[r["label"]]["eval"] = {"kld": r["kld"], "ppl_ratio": r["ppl_ratio"], "top1": r["top1"]}
    return out


def test_expectations_pass_on_the_last_h200_results(cases: list) -> None:
    c = by_name(cases)
    for name, o in h200_outcomes().items():
        checks = cr.evaluate(c[name], o)
        assert [ch for ch in checks if ch["status"] == "fail"] == [], name
        assert cr.verdict({**o, "checks": checks}) == "pass"
        ran = {ch["check"] for ch in checks if ch["status"] == "pass"}
        assert {"loads", "quantization", "kernel", "tok/s b1", "tok/s b16"} <= ran, name
    fp8 = cr.evaluate(c["fp8-static"], h200_outcomes()["fp8-static"])
    assert {ch["check"]: ch["status"] for ch in fp8} == {
        "loads": "pass", "quantization": "pass", "kernel": "pass", "tok/s b1": "pass", "tok/s b16": "pass",
        "smoke": "pass", "doctor agrees": "pass", "kld": "pass", "ppl_ratio": "pass", "top1": "pass"}


def test_failures_are_named(cases: list) -> None:
    c = by_name(cases)
    o = h200_outcomes()["gptq-w4g128"]
    o["load"]["facts"]["linear"] = [["CompressedTensorsWNA16", "MarlinLinearKernel"]]  # vLLM picked another
    o["eval"]["kld"] = 0.2
    checks = {ch["check"]: ch for ch in cr.evaluate(c["gptq-w4g128"], o)}
    assert checks["kernel"]["status"] == "fail" and checks["kld"]["status"] == "fail"
    assert checks["kernel"]["actual"] == ["MarlinLinearKernel for CompressedTensorsWNA16"]
    assert cr.verdict({"checks": list(checks.values())}) == "fail"

    failed = {"load": {"status": "failed", "error": "ValueError: Failed to find a kernel", "facts": {}}}
    checks = {ch["check"]: ch for ch in cr.evaluate(c["rtn-w4g128"], failed)}
    assert checks["loads"]["status"] == "fail" and "Failed to find a kernel" in checks["loads"]["note"]
    assert checks["kernel"]["status"] == "skip" and checks["tok/s b1"]["status"] == "skip"

    refused = {**h200_outcomes()["awq-w4g128"]}
    refused["smoke"] = {"status": "refused", "doctor_ok": False, "doctor": ["fail: scheme: unknown"]}
    checks = {ch["check"]: ch for ch in cr.evaluate(c["awq-w4g128"], refused)}
    assert checks["smoke"]["status"] == "fail" and checks["doctor agrees"]["status"] == "fail"
    assert cr.verdict({"error": "produce: quantkit awq exited 1", "checks": []}) == "error"


# vLLM 0.26.0's log lines for fused experts, as its source writes them (compressed_tensors_moe.py, fused_moe/oracle)
MOE_LOGS = {
    "wna16": "(EngineCore_DP0 pid=1) INFO 12-01 10:00:00 [compressed_tensors_moe.py:175] Using "
             "CompressedTensorsWNA16MarlinMoEMethod\n(EngineCore_DP0 pid=1) INFO 12-01 10:00:00 [int_wna16.py:184] "
             "Using 'MARLIN' WNA16 MoE backend.\n",
    "fp8": "(EngineCore_DP0 pid=1) INFO 12-01 10:00:00 [fp8.py:405] Using VLLM_CUTLASS Fp8 MoE backend out of "
           "potential backends: ['AITER', 'FLASHINFER_TRTLLM', 'FLASHINFER_CUTLASS', 'DEEPGEMM', 'VLLM_CUTLASS', "
           "'TRITON', 'MARLIN'].\n",
    "int8": "INFO 12-01 10:00:00 [int8.py:173] Using TRITON Int8 MoE backend out of potential backends: "
            "['TRITON', 'HUMMING'].\n",
    "dense": "INFO 12-01 10:00:00 [kernels.py:1] Using MacheteLinearKernel for CompressedTensorsWNA16\n",
}


def test_moe_facts_from_vllm_logs() -> None:
    wna16 = cr.moe_facts(MOE_LOGS["wna16"], "compressed-tensors")
    assert wna16 == {"method": "CompressedTensorsWNA16MarlinMoEMethod", "method_from": "log",
                     "methods": ["CompressedTensorsWNA16MarlinMoEMethod"], "backends": ["MARLIN (WNA16)"]}
    fp8 = cr.moe_facts("\x1b[1;36m" + MOE_LOGS["fp8"], "compressed-tensors")
    assert fp8["method"] == "CompressedTensorsW8A8Fp8MoEMethod" and fp8["method_from"] == "oracle line"
    assert fp8["backends"] == ["VLLM_CUTLASS (Fp8)"]
    assert cr.moe_facts(MOE_LOGS["int8"], "compressed-tensors")["method"] == "CompressedTensorsW8A8Int8MoEMethod"
    assert cr.moe_facts(MOE_LOGS["fp8"], "modelopt")["method"] is None  # another loader's method: not implied
    assert cr.moe_facts(MOE_LOGS["dense"], "compressed-tensors") is None
    # the same lines give kernels.log_facts' MoE backend, which moe_kernel checks
    assert kernels.log_facts(MOE_LOGS["fp8"]).moe == ("VLLM_CUTLASS",)
    assert kernels.log_facts(MOE_LOGS["wna16"]).moe == ("MARLIN",)


def moe_outcome(log: str, quantization: str = "compressed-tensors") -> dict:
    facts = kernels.log_facts(log + f"quantization={quantization}\n")
    return {"load": {"status": "ok", "facts": facts.to_json(), "decode_tok_s": {"1": 100.0, "16": 900.0},
                     "moe": cr.moe_facts(log, quantization)}}


def test_moe_checks(cases: list) -> None:
    c = by_name(cases)
    checks = {ch["check"]: ch for ch in cr.evaluate(c["moe-fp8-static"], moe_outcome(
        "Using CutlassFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8\n" + MOE_LOGS["fp8"]))}
    assert checks["moe_method"]["status"] == "pass" and checks["moe_kernel"]["status"] == "pass"
    assert checks["moe_method"]["actual"] == ["CompressedTensorsW8A8Fp8MoEMethod (from oracle line)"]
    assert checks["engines agree"]["status"] == "skip"  # no eval ran
    triton = MOE_LOGS["fp8"].replace("Using VLLM_CUTLASS", "Using TRITON")
    checks = {ch["check"]: ch for ch in cr.evaluate(c["moe-fp8-static"], moe_outcome(triton))}
    assert checks["moe_kernel"]["status"] == "fail" and checks["moe_kernel"]["actual"] == ["TRITON"]
    # WNA16: the method and backend recorded; AWQ must get Marlin, the others may get either WNA16 method
    other = MOE_LOGS["wna16"].replace("WNA16MarlinMoEMethod", "WNA16MoEMethod").replace("'MARLIN'", "'X'")
    assert {ch["check"]: ch["status"] for ch in cr.evaluate(c["moe-gptq-w4g128"], moe_outcome(
        "Using MacheteLinearKernel for CompressedTensorsWNA16\n" + other))}["moe_method"] == "pass"
    assert {ch["check"]: ch["status"] for ch in cr.evaluate(c["moe-awq-w4g128"], moe_outcome(
        "Using MacheteLinearKernel for CompressedTensorsWNA16\n" + other))}["moe_method"] == "fail"


def test_engine_agreement(cases: list) -> None:
    case = by_name(cases)["moe-gptq-w4g128"]
    o = moe_outcome("Using MacheteLinearKernel for CompressedTensorsWNA16\n" + MOE_LOGS["wna16"])
    o["eval"] = {"ppl": 16.30, "kld": 0.02, "top1": 0.9, "ppl_ratio": 1.03}
    o["eval_transformers"] = {"ppl": 16.25, "kld": 0.021, "top1": 0.905}
    checks = {ch["check"]: ch for ch in cr.evaluate(case, o)}
    assert checks["engines agree"]["status"] == "pass" and checks["engines agree"]["actual"] == pytest.approx(
        16.30 / 16.25 - 1)
    o["eval_transformers"]["ppl"] = 15.0
    assert {ch["check"]: ch for ch in cr.evaluate(case, o)}["engines agree"]["status"] == "fail"
    o["eval_transformers"]["ppl"] = 16.25
    md = cr.markdown([{"name": case.name, "status": "pass", **o}], {})
    assert "## vLLM vs transformers" in md and "| moe-gptq-w4g128 | 16.300 | 16.250 | +0.31% | 0.9000 | 0.9050 |" in md
    row = next(line for line in md.splitlines() if line.startswith("| moe-gptq-w4g128 | - | yes |"))
    assert "MARLIN (MoE)<br>CompressedTensorsWNA16MarlinMoEMethod" in row


def test_the_runner_reads_moe_facts_from_the_load_log(tmp_path: Path) -> None:
    log = tmp_path / "load.log"
    log.write_text(MOE_LOGS["int8"])
    load = {"log": str(log), "facts": {"quantization": None}, "extra": {"quantization": "compressed-tensors"}}
    assert gc.load_moe(load)["method"] == "CompressedTensorsW8A8Int8MoEMethod"
    assert gc.load_moe({"log": str(tmp_path / "missing.log")}) is None


def test_regex_and_substring_patterns() -> None:
    lines = ["MacheteLinearKernel for CompressedTensorsWNA16"]
    assert cr.matches("Machete", lines) and cr.matches("/^(Machete|Marlin)LinearKernel for /", lines)
    assert not cr.matches("/^Marlin/", lines) and not cr.matches("Marlin", lines)


def test_markdown_table(cases: list) -> None:
    results = []
    for name, o in h200_outcomes().items():
        o = {"name": name, **o, "artifact": {"status": "built"}}
        o["checks"] = cr.evaluate(by_name(cases)[name], o)
        o["status"] = cr.verdict(o)
        results.append(o)
    sweep_case = by_name(cases)["rtn-w4g128-8b"]
    config = kernels.Configuration("MarlinLinearKernel", "linear", (("CompressedTensorsWNA16", "MarlinLinearKernel"),),
                                   {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"})
    m = kernels.Measurement(config, "ok", kernels.LogFacts(None, (("CompressedTensorsWNA16", "MarlinLinearKernel"),)),
                            0.03, {"1": 303.0, "16": 3700.0})
    choice = kernels.choose([m])
    results.append({"name": sweep_case.name, "status": "pass", "sweep": {
        "bench": {"batches": [1, 16]}, "measurements": [m.to_json()], "choice": choice.to_json(),
        "command": kernels.serve_command("/a", choice.configuration).to_json()}})
    md = cr.markdown(results, {"started": "t0", "updated": "t1", "gpus": ["NVIDIA H200, 143771 MiB"],
                               "vllm": "0.26.0"})
    row = next(line for line in md.splitlines() if line.startswith("| fp8-static |"))
    assert "CutlassFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8" in row and "| 175 | 2019 |" in row
    assert "| 0.0055 | 1.0063 | 0.947 | 10/10 | pass |" in row
    assert "## Kernel sweep: rtn-w4g128-8b" in md
    assert "Serve with: `VLLM_DISABLED_KERNELS=MacheteLinearKernel vllm serve /a`" in md


# ------------------------------------------------------------------------------------------------------------------
# Scheduling and the run's files


def test_exclusive_use_waits_for_shared_users() -> None:
    gate = gc.GpuGate(stagger=0)
    events: list[str] = []

    def shared() -> None:
        with gate.use():
            events.append("shared in")
            time.sleep(0.3)
            events.append("shared out")

    t = threading.Thread(target=shared)
    t.start()
    time.sleep(0.1)
    with gate.use(exclusive=True):
        events.append("exclusive")
    t.join()
    assert events == ["shared in", "shared out", "exclusive"]


def test_stagger_spaces_engine_starts() -> None:
    gate = gc.GpuGate(stagger=0.2)
    t = time.monotonic()
    gate.engine_start()
    gate.engine_start()
    assert time.monotonic() - t >= 0.2


def test_a_stopped_run_lists_every_case_left_as_not_run(tmp_path: Path, cases: list) -> None:
    """Ctrl-C or SIGTERM: no case starts after it, each is listed as not run, the cases an earlier run finished are
    kept (--resume), and the results are still written."""
    picked = cf.select(cases, ["legacy", "modelopt-fp8"], [])
    run = gc.Run(picked, paths(tmp_path), opts("--out", str(tmp_path)),
                 previous={"gptq-legacy": {"name": "gptq-legacy", "status": "pass"}})
    run.stop.set()
    run.run()
    data = json.loads((tmp_path / "results.json").read_text())
    status = {r["name"]: (r["status"], r.get("reason", "")) for r in data["cases"]}
    assert status == {"gptq-legacy": ("pass", ""), "awq-legacy": ("not run", "stopped"),
                      "modelopt-fp8": ("not run", "stopped")}
    assert "| awq-legacy | - | - |" in (tmp_path / "results.md").read_text()
    assert "awq-legacy: not run (stopped)" in (tmp_path / "progress.log").read_text()
    assert not (tmp_path / "logs").exists()  # nothing was started


@pytest.mark.slow
def test_sigterm_stops_a_running_case_and_keeps_the_results(tmp_path: Path) -> None:
    """`timeout -s TERM` around a run (docs/testing.md): the step under way is stopped with its process group, the
    case is recorded as interrupted, the results are written, and the runner exits 130."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")  # found by the preflight; never started: the produce step is stopped
    f = tmp_path / "cases.yaml"
    f.write_text("cases:\n  - name: gptq\n    produce: {verb: gptq}\n    expect: {kernel: Machete}\n")
    out = tmp_path / "out"
    runner = subprocess.Popen([sys.executable, str(SCRIPT), "--cases", str(f), "--out", str(out), "--vllm-python",
                               sys.executable, "--vllm-path", str(site)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and "gptq: produce:" not in _text(out / "progress.log"):
            time.sleep(0.5)
        time.sleep(3)
        runner.terminate()
        stdout, stderr = runner.communicate(timeout=120)
    finally:
        runner.kill()
    assert runner.returncode == 130, stderr
    case = json.loads((out / "results.json").read_text())["cases"][0]
    assert case["status"] == "interrupted" and "produce" in case["error"], case
    assert "signal 15: stopping every child process" in _text(out / "progress.log")
    assert not (out / "arts" / "gptq" / "quantkit.json").exists() and "| gptq |" in stdout


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.mark.slow
def test_a_case_end_to_end_without_vllm(tmp_path: Path) -> None:
    """One real case on this CPU: the real quantkit CLI produces the artifact, the real child finds no vLLM, the
    loads check fails with that reason; a second run reuses the artifact."""
    f = tmp_path / "cases.yaml"
    f.write_text("cases:\n  - name: rtn\n    produce: {verb: rtn}\n    expect: {kernel: Machete, min_tok_s: {1: 1}}\n")
    p = paths(tmp_path, "--vllm-path", str(tmp_path / "no-vllm"))
    p.write_wrappers()
    cases = cf.load_cases(f)
    gc.Run(cases, p, opts("--parallel", "1", "--out", str(tmp_path)), {}).run()
    r = json.loads((tmp_path / "results.json").read_text())["cases"][0]
    assert r["artifact"]["status"] == "built" and (tmp_path / "arts" / "rtn" / "quantkit.json").is_file()
    assert json.loads((tmp_path / "logs" / "rtn" / "produce.json").read_text())  # --json kept apart from stderr
    checks = {ch["check"]: ch for ch in r["checks"]}
    assert r["status"] == "fail" and checks["loads"]["status"] == "fail" and "vllm" in checks["loads"]["note"]
    assert checks["kernel"]["status"] == "skip" and checks["tok/s b1"]["status"] == "skip"
    gc.Run(cases, p, opts("--parallel", "1", "--out", str(tmp_path)), {}).run()
    assert json.loads((tmp_path / "results.json").read_text())["cases"][0]["artifact"]["status"] == "reused"


def test_a_measurement_missing_from_a_step_that_ran_fails(cases: list) -> None:
    """The fp8-block case once passed with its batch-16 tok/s missing (the check said skip): a load that succeeded
    and has no figure for an expected batch, or an evaluation that ran and lacks a metric, is a failed check."""
    c = by_name(cases)
    o = h200_outcomes()["gptq-w4g128"]
    del o["load"]["decode_tok_s"]["16"]
    del o["eval"]["kld"]
    checks = {ch["check"]: ch for ch in cr.evaluate(c["gptq-w4g128"], o)}
    assert checks["tok/s b16"]["status"] == "fail" and "not measured" in checks["tok/s b16"]["note"]
    assert checks["tok/s b1"]["status"] == "pass"
    assert checks["kld"]["status"] == "fail" and "did not report" in checks["kld"]["note"]
    assert cr.verdict({**o, "checks": list(checks.values())}) == "fail"


def test_a_shared_gpu_gets_a_fixed_kv_cache_at_parallel_one(cases: list) -> None:
    """The 2026-12-02 VLM run (--parallel 1 beside the SGLang job): vLLM sized its KV cache by profiling, and an
    SGLang server that stopped meanwhile tripped its check ("Error in memory profiling"). --shared-gpu keeps the
    fixed cache; an exclusive timed step still lets vLLM size its own."""
    c = by_name(cases)
    assert gc.kv_bytes(c["vlm-gemma3-gptq"], opts("--parallel", "1")) is None
    assert gc.kv_bytes(c["vlm-gemma3-gptq"], opts("--parallel", "1", "--shared-gpu")) == 4 * 2**30
    exclusive = next(x for x in cases if x.exclusive)
    assert gc.kv_bytes(exclusive, opts("--shared-gpu"), timed=True) is None
