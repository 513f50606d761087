"""``quantkit smoke`` and ``quantkit doctor``, for real: llama-server (and llama-cpp-python's server, the fallback
where llama-server is missing) on a GGUF of the reference model, server processes that must be gone after success,
failure, timeout, Ctrl-C and SIGTERM, and version skew checks on a real compressed-tensors checkpoint. The vLLM
test needs a CUDA GPU and vLLM, and skips without."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, TINY, gone, has_cuda, live_children, quantkit

pytestmark = pytest.mark.e2e

# A real llama.cpp server behind a shell that waits first: the smoke process is caught while it waits for
# health, and the server's process group holds two processes (sh and sleep) that must both be stopped.
SLOW_SERVER = "sh -c 'sleep 120; exec {python} -m llama_cpp.server --model {model} --host {host} --port {port}'"

# Numbers no smoke run could mean: the flag, its value, and what the usage error says of it.
BAD_NUMBERS = [
    ("--port", "99999", "--port: Input should be less than or equal to 65535 (got 99999)"),
    ("--port", "-1", "--port: Input should be greater than or equal to 0 (got -1)"),
    ("--timeout", "-1", "--timeout: Input should be greater than 0 (got -1.0)"),
    ("--timeout", "0", "--timeout: Input should be greater than 0 (got 0.0)"),
    ("--max-tokens", "-5", "--max-tokens: Input should be greater than or equal to 1 (got -5)"),
    ("--max-tokens", "0", "--max-tokens: Input should be greater than or equal to 1 (got 0)"),
    ("--speed-tokens", "-1", "--speed-tokens: Input should be greater than or equal to 1 (got -1)"),
    ("--match-tokens", "-1", "--match-tokens: Input should be greater than or equal to 1 (got -1)"),
]


@pytest.fixture(scope="session")
def gguf_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An F16 GGUF artifact of the reference model, written by quantkit's own converter."""
    out = tmp_path_factory.mktemp("smoke") / "tiny-gguf"
    quantkit("gguf", TINY, out, "-t", "F16", check=True)
    return out


@pytest.fixture(scope="session")
def ct_artifact(tiny_rtn: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compressed-tensors W4A16 (pack-quantized) artifact of the reference model: ``quantkit rtn``, the session's
    (tests/conftest.py) copied, as a smoke test records its runs in the artifact."""
    out = tmp_path_factory.mktemp("ct") / "tiny-w4a16"
    shutil.copytree(tiny_rtn, out)
    return out


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_smoke_gguf_in_llamacpp_server(gguf_artifact: Path) -> None:
    proc = quantkit("smoke", gguf_artifact, "--baseline", "source", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["ok"] and res["engine"] == "llama.cpp" and len(res["runs"]) == 1
    run = res["runs"][0]
    assert run["status"] == "passed"
    assert run["models"] and run["completion"]["text"].strip() and run["chat"]["text"].strip()
    assert run["ttft_s"] > 0 and run["decode_tokens_per_s"] > 0 and run["stream_tokens"] > 1
    assert run["decode_clock"] == "server"  # llama-server's own timings, not the events' arrival in the client
    # llama.cpp's own server, built from llama-cpp-python's llama.cpp, chatting with the GGUF's own template
    assert Path(run["command"].split()[0]).name == "llama-server" and "--jinja" in run["command"]
    assert run["facts"]["server"] == "llama-server b11312 (0c1e57098)"
    assert run["facts"]["file_type"] == "F16"
    b = run["baseline"]
    assert b["compared"] == 8 and 0 <= b["matched"] <= 8 and b["baseline_text"].strip()
    assert res["doctor"]["ok"]

    # the server is gone once quantkit returns, and the run is recorded in the (still valid) manifest
    assert run["stopped"] and gone(run["pid"]) and _port_closed(run["port"])
    log = Path(run["log"])
    assert log.exists() and log.parent == gguf_artifact.parent and "llama-server" in log.read_text()
    manifest = json.loads((gguf_artifact / "quantkit.json").read_text())
    recorded = manifest["smoke"]["runs"][f"llama.cpp:{run['file']}"]
    assert recorded["status"] == "passed" and recorded["decode_tokens_per_s"] == run["decode_tokens_per_s"]
    assert quantkit("verify", gguf_artifact).returncode == 0


def test_smoke_falls_back_to_llama_cpp_python_server(gguf_artifact: Path, tmp_path: Path) -> None:
    # a tools folder without llama-server: the Python server answers instead, and the run says so
    proc = quantkit("smoke", gguf_artifact, "--log-dir", tmp_path, "--json", timeout=600,
                    env={"QUANTKIT_LLAMACPP_BIN": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)["runs"][0]
    assert run["status"] == "passed" and run["completion"]["text"].strip() and run["chat"]["text"].strip()
    assert "-m llama_cpp.server" in run["command"]
    assert "--chat_format chat_template.default" in run["command"]  # the GGUF's own template
    assert run["facts"]["server"].startswith("llama_cpp.server (llama-cpp-python), the fallback")
    assert run["facts"]["chat_format"] == "the GGUF's chat template"
    assert "llama.cpp's tools are not installed" in proc.stderr  # doctor's warning, shown before the run
    assert run["stopped"] and gone(run["pid"])


def test_server_that_cannot_load_fails_clearly_and_keeps_its_log(gguf_artifact: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    gguf = next(gguf_artifact.glob("*.gguf"))
    (broken / "model.gguf").write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 4])

    # doctor sees the truncated file first and refuses to start a server
    refused = quantkit("smoke", broken, "--json", timeout=300)
    assert refused.returncode == 1
    run = json.loads(refused.stdout)["runs"][0]
    assert run["status"] == "refused" and "not a readable GGUF" in run["error"] and run["log"] is None

    # forced past doctor, llama.cpp itself fails to load it: the error shows the log's tail, the log is kept
    proc = quantkit("smoke", broken, "--skip-doctor", "--json", timeout=300)
    assert proc.returncode == 1
    run = json.loads(proc.stdout)["runs"][0]
    assert run["status"] == "failed"
    assert "exited with code" in run["error"] and "before it was ready" in run["error"]
    assert "failed to load model" in run["error"]  # a line from the server's own log
    assert "the whole log is" in proc.stderr and "failed to load model" in proc.stderr
    log = Path(run["log"])
    assert log == tmp_path / "broken.smoke-llama.cpp-model.log" and "llama-server" in log.read_text()
    assert gone(run["pid"])


def test_a_tampered_artifact_is_refused_before_serving_and_stays_unsealed(gguf_artifact: Path, tmp_path: Path) -> None:
    """smoke served a changed weight file (or beside a file dropped in) and recorded its run by re-hashing the
    folder: the tampered files were sealed into quantkit.json and verify said ok. Now it checks the seal first."""
    changed = shutil.copytree(gguf_artifact, tmp_path / "changed")
    gguf = next(changed.glob("*.gguf"))
    with open(gguf, "r+b") as f:
        f.seek(gguf.stat().st_size // 2)
        f.write(b"\xff" * 64)
    added = shutil.copytree(gguf_artifact, tmp_path / "added")
    (added / "evil.sh").write_text("#!/bin/sh\n")
    for art, target, found in [(changed, changed, f"changed ['{gguf.name}']"),
                               (changed, gguf, f"changed ['{gguf.name}']"), (added, added, "not listed ['evil.sh']")]:
        sealed = (art / "quantkit.json").read_bytes()
        proc = quantkit("smoke", target, "--log-dir", tmp_path, timeout=300)
        assert proc.returncode == 1 and f"refusing to smoke-test {art}" in proc.stderr, proc.stderr[-2000:]
        assert found in proc.stderr and "Traceback" not in proc.stderr
        assert not list(tmp_path.glob("*.log"))  # no server was started
        assert (art / "quantkit.json").read_bytes() == sealed and quantkit("verify", art).returncode == 1


def test_timeout_stops_the_whole_process_group(gguf_artifact: Path, tmp_path: Path) -> None:
    proc = quantkit("smoke", gguf_artifact, "--server-cmd", SLOW_SERVER, "--timeout", "3", "--log-dir", tmp_path,
                    "--json", timeout=300)
    assert proc.returncode == 1
    run = json.loads(proc.stdout)["runs"][0]
    assert run["status"] == "failed" and "did not answer /v1/models within 3s" in run["error"]
    assert run["stopped"] and gone(run["pid"])
    assert not [p for p in psutil.process_iter(["cmdline"]) if "sleep 120" in " ".join(p.info["cmdline"] or [])
                and str(gguf_artifact) in " ".join(p.info["cmdline"] or [])]


def test_a_fixed_port_serves_every_file_in_turn(gguf_artifact: Path, tmp_path: Path) -> None:
    """Two .gguf files on one --port: the second server starts while the first's connections wait in TIME_WAIT,
    which the port check called "already in use" (exit 2) most times."""
    from quantkit.engines.serving import free_port

    two = tmp_path / "two"
    two.mkdir()
    gguf = next(gguf_artifact.glob("*.gguf"))
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(gguf, two / name)
    port = free_port()
    proc = quantkit("smoke", two, "--port", port, "--log-dir", tmp_path, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout)["runs"]
    assert [(r["file"], r["status"], r["port"]) for r in runs] == [("a.gguf", "passed", port),
                                                                   ("b.gguf", "passed", port)]
    assert all(gone(r["pid"]) for r in runs)


@pytest.mark.cli
@pytest.mark.parametrize("flag, value, says", BAD_NUMBERS, ids=[f"{f}={v}" for f, v, _ in BAD_NUMBERS])
def test_numbers_no_run_could_mean_are_refused_before_any_server(tmp_path: Path, flag: str, value: str,
                                                                   says: str) -> None:
    """A port out of range ended in a traceback; a timeout of -1 s started a server and blamed the artifact; a
    --max-tokens of -5 failed on the server's HTTP 400, 0 passed with one token; --speed-tokens and --match-tokens
    of -1 passed. Each is a usage error (exit 2) in one line, one JSON document under --json, and no server starts
    (the server command would leave a file)."""
    art = tmp_path / "art"
    art.mkdir()
    (art / "m.gguf").write_bytes(b"")
    started = tmp_path / "started"
    args = ("smoke", art, flag, value, "--skip-doctor", "--server-cmd", f"sh -c 'touch {started}'",
            "--log-dir", tmp_path / "logs")
    proc = quantkit(*args, "--json", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {"ok": False, "error": f"invalid smoke option: {says}", "hint": None,
                                       "exit_code": 2}
    human = quantkit(*args, timeout=120)
    assert human.returncode == 2 and human.stderr.strip() == f"error: invalid smoke option: {says}"
    assert not started.exists() and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signal_while_waiting_stops_the_server(gguf_artifact: Path, tmp_path: Path, sig: signal.Signals) -> None:
    # A shell that starts jobs in the background ignores SIGINT in them; a terminal's Ctrl-C does not.
    proc = subprocess.Popen(
        [sys.executable, "-m", "quantkit", "smoke", str(gguf_artifact), "--server-cmd", SLOW_SERVER,
         "--log-dir", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    server: list[psutil.Process] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(server) < 2:  # sh and its sleep, both in the server's group
        server = [c for c, cmd in live_children(proc.pid) if cmd[:2] == ["sh", "-c"] or cmd[:1] == ["sleep"]]
        time.sleep(0.2)
    assert len(server) == 2, "the slow server never started"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "server was stopped" in err
    assert all(gone(p) for p in server)
    assert (tmp_path / f"{gguf_artifact.name}.smoke-llama.cpp-{next(gguf_artifact.glob('*.gguf')).stem}.log").exists()


@pytest.mark.cli
def test_doctor_lists_versions() -> None:
    proc = quantkit("doctor", "--engine", "llama.cpp", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    versions = rep["quantkit"]["versions"]
    for dist in ("torch", "transformers", "llmcompressor", "compressed-tensors", "gguf", "llama_cpp_python"):
        assert versions.get(dist), dist
    assert isinstance(rep["quantkit"]["torch"]["cuda_available"], bool)
    assert rep["engine"]["name"] == "llama.cpp" and rep["engine"]["version"] == versions["llama_cpp_python"]
    assert rep["ok"] and any(c["name"] == "engine installed" and c["status"] == "ok" for c in rep["checks"])
    # llama.cpp's tools: their build and commit, the same llama.cpp as the library's
    tools = next(c for c in rep["checks"] if c["name"] == "llama.cpp tools")
    assert tools["status"] == "ok", tools
    assert "llama-server" in tools["message"] and "llama-quantize" in tools["message"]
    assert "b11312 (0c1e57098)" in tools["message"] and "llama-cpp-python 0.3.36" in tools["message"]


def _checks(proc: subprocess.CompletedProcess) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(proc.stdout)["checks"]}


def test_doctor_flags_unknown_compressed_tensors_format(ct_artifact: Path, tmp_path: Path) -> None:
    good = _checks(quantkit("doctor", ct_artifact, "--engine", "vllm", "--json", timeout=300))
    assert good["format"]["status"] == "ok" and good["scheme"]["status"] == "ok"

    skewed = tmp_path / "skewed"
    shutil.copytree(ct_artifact, skewed)
    cfg = json.loads((skewed / "config.json").read_text())
    cfg["quantization_config"]["format"] = "pack-quantized-v9"
    for group in cfg["quantization_config"]["config_groups"].values():
        group["format"] = "pack-quantized-v9"
    (skewed / "config.json").write_text(json.dumps(cfg))
    proc = quantkit("doctor", skewed, "--engine", "vllm", "--json", timeout=300)
    assert proc.returncode == 1
    checks = _checks(proc)
    assert checks["format"]["status"] == "fail" and "'pack-quantized-v9' is unknown" in checks["format"]["message"]
    assert "compressed-tensors" in checks["format"]["message"]

    # a scheme field the reading compressed-tensors does not know (what a newer writer adds) is a failure too
    cfg["quantization_config"]["format"] = "pack-quantized"
    for group in cfg["quantization_config"]["config_groups"].values():
        group["format"] = "pack-quantized"
        group["weights"]["scale_layout"] = "interleaved"
    (skewed / "config.json").write_text(json.dumps(cfg))
    checks = _checks(quantkit("doctor", skewed, "--engine", "vllm", "--json", timeout=300))
    assert checks["format"]["status"] == "ok"
    assert checks["scheme"]["status"] == "fail" and "scale_layout" in checks["scheme"]["message"]

    # smoke refuses the artifact first, its config.json being changed since it was sealed; a checkpoint with no
    # quantkit.json it checks with doctor first and stops before starting any server
    sealed = quantkit("smoke", skewed, "--engine", "vllm", "--log-dir", tmp_path / "logs", timeout=300)
    assert sealed.returncode == 1 and "changed ['config.json']" in sealed.stderr, sealed.stderr
    (skewed / "quantkit.json").unlink()
    proc = quantkit("smoke", skewed, "--engine", "vllm", "--log-dir", tmp_path / "logs", "--json", timeout=300)
    assert proc.returncode == 1
    run = json.loads(proc.stdout)["runs"][0]
    assert run["status"] == "refused" and "scale_layout" in run["error"]
    assert not (tmp_path / "logs").exists()


@pytest.mark.unit
def test_vllm_log_facts_name_the_kernel() -> None:
    from quantkit.engines.vllm import server as vllm

    log = (
        "INFO 11-29 10:00:01 [model.py:1] Initializing a V1 LLM engine (v0.26.0) with config: "
        "model='/a/awq', quantization=compressed-tensors, enforce_eager=True\n"
        "INFO 11-29 10:00:20 [compressed_tensors_wNa16.py:95] Using MarlinLinearKernel for CompressedTensorsWNA16\n"
        "INFO 11-29 10:00:21 [cuda.py:274] Using FLASH_ATTN attention backend.\n"
    )
    facts = vllm.SERVER.log_facts(log)
    assert facts["quantization"] == "compressed-tensors"
    assert facts["kernels"] == ["MarlinLinearKernel for CompressedTensorsWNA16"]
    assert facts["schemes"] == ["CompressedTensorsWNA16"] and facts["attention_backend"] == "FLASH_ATTN"
    failed = log + "ValueError: Unsupported compressed-tensors scheme for layer q_proj\n"
    assert vllm.SERVER.log_facts(failed)["error"].startswith("ValueError: Unsupported")


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
def test_vllm_serves_compressed_tensors(ct_artifact: Path, tmp_path: Path) -> None:
    doctor = json.loads(quantkit("doctor", "--engine", "vllm", "--json", timeout=600).stdout)
    if not any(c["name"] == "engine installed" and c["status"] == "ok" for c in doctor["checks"]):
        pytest.skip("vLLM is not installed (set QUANTKIT_VLLM_PYTHON to its Python)")
    proc = quantkit("smoke", ct_artifact, "--engine", "vllm", "--log-dir", tmp_path, "--json", timeout=900,
                    env={"VLLM_USE_FLASHINFER_SAMPLER": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)["runs"][0]
    assert run["status"] == "passed" and run["completion"]["text"].strip() and run["decode_tokens_per_s"] > 0
    assert run["facts"]["quantization"] == "compressed-tensors" and gone(run["pid"])


def test_tp_that_cuts_a_quantization_group_is_refused_before_any_server(ct_artifact: Path, tmp_path: Path) -> None:
    """The reference model's intermediate size 768 over 4 GPUs is 192 columns: not a whole number of 128-wide
    groups, which vLLM would report only after loading. quantkit refuses it (exit 2) and names what fits."""
    from quantkit.engines import parallel

    assert parallel.problems(ct_artifact, 2) == []
    assert parallel.largest_tp(ct_artifact) == 2
    proc = quantkit("smoke", ct_artifact, "--engine", "vllm", "--tp", "4", "--log-dir", tmp_path,
                    env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    if "GPU(s) visible" in proc.stderr:
        pytest.skip("this machine shows fewer than 4 GPUs to nvidia-smi; the shape check comes after that one")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "intermediate_size / 4 = 192 is not a multiple of the quantization group 128" in proc.stderr
    assert "largest tensor-parallel size it allows is 2" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # no server started, no log written
    heads = quantkit("smoke", TINY, "--engine", "vllm", "--tp", "3", env={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    if "GPU(s) visible" not in heads.stderr:
        assert heads.returncode == 2 and "4 attention heads are not divisible by 3" in heads.stderr


def test_tp_reaches_the_server_command_and_llamacpp_refuses_it(gguf_artifact: Path) -> None:
    from quantkit.engines.llamacpp import server as llamacpp
    from quantkit.engines.trtllm import server as trtllm
    from quantkit.engines.vllm import server as vllm
    from quantkit.engines.serving import ServeOptions

    argv = vllm.SERVER.command(TINY, "python", "127.0.0.1", 8000, ServeOptions(tp=2))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in vllm.SERVER.command(TINY, "python", "127.0.0.1", 8000, ServeOptions())
    argv = trtllm.SERVER.command(TINY, "python", "127.0.0.1", 8000, ServeOptions(tp=2))
    assert argv[argv.index("--tp_size") + 1] == "2"
    assert llamacpp.SERVER.name == "llama.cpp"
    proc = quantkit("smoke", gguf_artifact, "--tp", "2")
    assert proc.returncode == 2 and "llama.cpp's server has no tensor parallelism" in proc.stderr
    assert "split-mode option (row) through --server-arg" in proc.stderr
