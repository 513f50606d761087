"""bench/serve_bench.py: its arithmetic on recorded stream timings (TTFT, inter-token latency, tokens/s, ratios to
the reference), and one short run against a real llama-server on the real model (e2e); bench/serve_speed.py's work
folder (cli)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, quantkit

sys.path.insert(0, str(ROOT / "bench"))
import serve_bench  # noqa: E402
from serve_bench import Stream  # noqa: E402

pytestmark = pytest.mark.unit


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert serve_bench.percentile(xs, 50) == 2.5
    assert serve_bench.percentile(xs, 90) == pytest.approx(3.7)
    assert serve_bench.percentile(xs, 0) == 1.0 and serve_bench.percentile(xs, 100) == 4.0
    assert serve_bench.percentile([], 50) is None


def test_a_level_summarized_from_its_streams() -> None:
    """Two requests of 3 tokens: first chunks 0.1 s and 0.3 s after their sends, gaps 0.02, 0.04, 0.02, 0.06."""
    streams = [Stream(sent=10.0, arrivals=[10.1, 10.12, 10.16], tokens=3),
               Stream(sent=10.0, arrivals=[10.3, 10.32, 10.38], tokens=3)]
    f = serve_bench.summarize(streams, wall_s=0.5)
    assert f["requests"] == 2 and f["output_tokens"] == 6 and f["output_tokens_per_s"] == 12.0
    assert f["ttft_ms_p50"] == pytest.approx(200.0) and f["ttft_ms_p90"] == pytest.approx(280.0)
    assert f["itl_ms_p50"] == pytest.approx(30.0) and f["itl_ms_p90"] == pytest.approx(54.0)
    assert f["tpot_ms_mean"] == pytest.approx((30.0 + 40.0) / 2)


def test_a_one_token_request_has_a_ttft_and_no_inter_token_latency() -> None:
    f = serve_bench.summarize([Stream(sent=0.0, arrivals=[0.05], tokens=1)], wall_s=0.05)
    assert f["ttft_ms_p50"] == pytest.approx(50.0)
    assert f["itl_ms_p50"] is None and f["tpot_ms_mean"] is None


def test_ratios_against_the_reference_at_the_same_level() -> None:
    ref = {"levels": {"1": {"output_tokens_per_s": 100.0, "ttft_ms_p50": 40.0, "itl_ms_p50": 10.0},
                      "4": {"output_tokens_per_s": 300.0, "ttft_ms_p50": 80.0, "itl_ms_p50": 12.0}}}
    row = {"levels": {"1": {"output_tokens_per_s": 150.0, "ttft_ms_p50": 30.0, "itl_ms_p50": 6.5},
                      "16": {"output_tokens_per_s": 900.0, "ttft_ms_p50": 90.0, "itl_ms_p50": 15.0}}}
    r = serve_bench.ratios(row, ref)
    assert r == {"1": {"output_tokens_per_s": 1.5, "ttft_ms_p50": 0.75, "itl_ms_p50": 0.65}}  # no level 16 there


def test_deployment_flags_size_the_server_for_the_largest_level() -> None:
    extra, ctx = serve_bench.deployment_args("llama.cpp", 4, prompt_len=100, gen=20)
    assert ctx == 136 and extra == ["--parallel", "4", "--ctx-size", str(136 * 4)]
    extra, _ = serve_bench.deployment_args("vllm", 64, 512, 128)
    sizes = json.loads(extra[extra.index("--compilation-config") + 1])["cudagraph_capture_sizes"]
    assert sizes == [1, 2, 4, 8, 16, 32, 64] and "--no-enforce-eager" in extra


def test_a_failed_row_says_failed_and_its_whole_error_is_listed_under_the_table() -> None:
    """The error is not cut to fit the cell (it was cut at 200 characters, mid-word): the cell says the row failed,
    the list under the engine's table gives the whole first line of each failed checkpoint's error (the JSON keeps
    the log tail after it)."""
    level = {"output_tokens_per_s": 100.0, "ttft_ms_p50": 40.0, "ttft_ms_p90": 45.0, "itl_ms_p50": 10.0,
             "itl_ms_p90": 12.0}
    line = ("the vllm server exited with code 1 while answering /health at " + "/w/out-quantkit-nvfp4 " * 10
            + "Last lines of /logs/vllm-out-quantkit-nvfp4.log:")
    error = line + "\nTraceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory"
    data = {"title": "Llama-3.1-8B", "command": "serve_bench.py", "date": "2026-12-05",
            "machine": {"cpu": "x", "cores": 1}, "versions": {}, "prompt_len": 16, "gen": 4, "rounds": 2,
            "reference": "bf16", "reference_path": "/w/src-8b", "load_average": [0.0, 0.0, 0.0],
            "rows": [{"engine": "vllm", "checkpoint": "bf16", "path": "/w/src-8b", "levels": {"1": level}},
                     {"engine": "vllm", "checkpoint": "nvfp4 NVFP4", "path": "/w/out-quantkit-nvfp4", "levels": {},
                      "error": error}]}
    md = serve_bench.markdown(data)
    assert md.startswith("# Serving benchmark: Llama-3.1-8B\n")
    assert "| nvfp4 NVFP4 | - | failed: see below | | | | |" in md
    table_end = md.index("| nvfp4 NVFP4 |")
    listed = [ln for ln in md[table_end:].splitlines() if ln.startswith("- ")]
    # the line introduces the log's tail, which only the JSON holds: it says so instead of ending on a colon
    assert listed == [f"- nvfp4 NVFP4 (`/w/out-quantkit-nvfp4`): {line.removesuffix(':')} (in results.json)"]
    assert md.count(line.removesuffix(":")) == 1 and "OutOfMemoryError" not in md and "| bf16 | 1 | 100.0 |" in md
    # an error recorded without its tail (the JSON of a run before the tail was kept) does not point to one
    data["rows"][1]["error"] = line
    assert f"{line.removesuffix(':')}\n" in serve_bench.markdown(data)


def test_the_default_title_names_the_model_not_its_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 reference folder's label is "bf16"; the title is its folder's name, a GGUF reference's the file's stem."""
    model = ROOT / "models" / "quantkit-tiny"
    assert serve_bench.label(model) == "bf16" and serve_bench.model_name(model) == "quantkit-tiny"
    assert serve_bench.model_name(Path("out/SmolLM2-135M-Instruct-F16.gguf")) == "SmolLM2-135M-Instruct-F16"
    (tmp_path / "Llama-3.1-8B").mkdir()
    monkeypatch.chdir(tmp_path / "Llama-3.1-8B")
    assert serve_bench.model_name(Path(".")) == "Llama-3.1-8B"


@pytest.mark.cli
@pytest.mark.parametrize("engine", ["llama.cpp", "vllm"])
def test_every_checkpoint_the_engine_cannot_serve_is_refused_before_any_server_starts(engine: str,
                                                                                       tmp_path: Path) -> None:
    """A missing path, a folder without config.json, a file where vLLM needs a folder (it is there: not "no such
    folder") or (for llama.cpp) a .gguf that is not there: all named in one
    argparse error line (exit 2) before the tokenizer loads or any server starts, not found in its turn after minutes
    of other servers. A good path beside them is not named."""
    good = ROOT / "models" / "quantkit-tiny"
    empty = tmp_path / "empty"
    empty.mkdir()
    gguf = tmp_path / "missing-Q4_K_M.gguf"
    reference = tmp_path / "F16.gguf" if engine == "llama.cpp" else good
    if engine == "llama.cpp":
        reference.write_bytes(b"GGUF")  # there: the check asks for a file, the server would read it
    weights = tmp_path / "model.safetensors"  # there, but neither a .gguf nor a folder
    weights.write_bytes(b"")
    checkpoints = [gguf, empty, tmp_path / "typo", weights]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_bench.py"), "--engine", engine,
                           "--reference", str(reference), *map(str, checkpoints), "--tokenizer", str(good),
                           "--results-dir", str(tmp_path / "res"), "--logs", str(tmp_path / "logs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (error,) = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    named = error.split(f"error: {engine} cannot serve ", 1)[1].split("; ")
    why = {"llama.cpp": ["no such file", "not a .gguf file", "not a .gguf file", "not a .gguf file"],
           "vllm": ["no such folder", "no config.json in it", "no such folder", "not a folder"]}[engine]
    assert named == [f"{p} ({w})" for p, w in zip(checkpoints, why)]
    assert str(reference) not in error and "Traceback" not in proc.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "res").exists() and "==" not in proc.stdout


@pytest.mark.e2e
def test_a_real_llama_server_on_the_reference_model(tmp_path: Path) -> None:
    """The reference model as Q8_0 GGUF behind the real llama-server, one client, tiny lengths: every request decodes
    exactly the asked tokens (checked by the script), and the table, JSON and plot are written. (The reference model,
    not SmolLM2: what is checked is the benchmark's plumbing, and its conversion takes seconds, not a minute.)"""
    model = ROOT / "models" / "quantkit-tiny"
    quantkit("gguf", model, tmp_path / "gguf", "-t", "Q8_0", check=True)
    (gguf,) = (tmp_path / "gguf").glob("*.gguf")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_bench.py"), "--engine", "llama.cpp",
                           "--reference", str(gguf), str(gguf), "--tokenizer", str(model), "--concurrency", "1",
                           "--rounds", "2", "--prompt-len", "16", "--gen", "4", "--results-dir", str(tmp_path),
                           "--name", "sb", "--logs", str(tmp_path / "logs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the wait on the server is shown, as the CLI shows it (the Python API's own waits are quiet)
    assert "waiting for the llama.cpp server on :" in proc.stderr and "llama.cpp server ready on" in proc.stderr
    data = json.loads((tmp_path / "sb" / "results.json").read_text())
    (row,) = data["rows"]
    level = row["levels"]["1"]
    assert level["requests"] == 2 and level["output_tokens"] == 8
    assert level["ttft_ms_p50"] > 0 and level["itl_ms_p50"] > 0 and level["output_tokens_per_s"] > 0
    assert (tmp_path / "sb" / "results.png").stat().st_size > 0
    assert f"| {gguf.stem} | 1 |" in (tmp_path / "sb" / "results.md").read_text()


@pytest.mark.cli
def test_serve_speed_work_folder_under_the_cache_root_or_workdir(tmp_path: Path) -> None:
    """bench/serve_speed.py keeps vLLM's logs and requests in WORKDIR/logs, WORKDIR being bench/serve_speed under
    quantkit's cache root unless --workdir names one (here vLLM is absent, so each run fails and is recorded)."""
    model = ROOT / "models" / "quantkit-tiny"
    cache = tmp_path / "cache"
    env = {**os.environ, "QUANTKIT_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for extra, logs in (([], cache / "bench" / "serve_speed" / "logs"),
                        (["--workdir", str(tmp_path / "w")], tmp_path / "w" / "logs")):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_speed.py"), str(model), "--vllm-path",
                               str(tmp_path / "none"), "--results-dir", str(tmp_path), "--name", "ss",
                               "--timeout", "120", "--batches", "1,4", *extra],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (logs / "quantkit-tiny.request.json").is_file() and (logs / "quantkit-tiny.log").is_file()
        data = json.loads((tmp_path / "ss.json").read_text())
        (row,) = data["rows"]
        assert "vllm" in row["error"] and data["batches"] == [1, 4]  # --batches through the shared int list
