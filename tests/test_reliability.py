"""Bad input, full disks, interruptions, concurrent runs and determinism, through the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from quantkit import artifact, integrity
from quantkit.errors import DiskSpaceError
from quantkit.manifest import Manifest, SourceInfo, read_manifest

from conftest import ROOT, quantkit, sparse_checkpoint

pytestmark = pytest.mark.e2e

SMALL = ("--samples", "8", "--seq-len", "128")


def tmpfs(path: Path, size: str):
    """Mount a small tmpfs (a real full disk); skip where the machine does not allow mounts."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    return path


@pytest.fixture()
def small_disk(tmp_path: Path):
    d = tmpfs(tmp_path / "disk", "2m")
    yield d
    subprocess.run(["umount", str(d)], check=False)


def test_enospc_while_writing_removes_the_partial_output(small_disk: Path) -> None:
    out = small_disk / "art"
    with pytest.raises(DiskSpaceError, match="disk filled up"):
        with artifact.ArtifactWriter(out) as w:  # the estimate (0) passes the pre-check; the disk is then too small
            with open(w.path / "model.safetensors", "wb") as f:
                for _ in range(64):
                    f.write(b"\0" * (1 << 16))
                    f.flush()
                    os.fsync(f.fileno())
    assert list(small_disk.iterdir()) == []


def test_free_space_precheck_on_a_real_small_disk(small_disk: Path, tiny: Path) -> None:
    proc = quantkit("rtn", tiny, small_disk / "rtn")
    assert proc.returncode == 1, proc.stderr
    assert "not enough free space" in proc.stderr and "Traceback" not in proc.stderr
    assert list(small_disk.iterdir()) == []


@pytest.mark.cli
def test_a_model_larger_than_host_memory_is_refused_before_loading(tmp_path: Path, tiny: Path) -> None:
    """A checkpoint twice this machine's RAM and swap (a sparse file: its header is real, its data takes no disk)
    is refused with the estimate and the limit, before a weight is read, and nothing is written."""
    from quantkit import recipe, source
    from quantkit.plan import check_host_memory, host_limit

    limit = host_limit()
    if limit is None:
        pytest.skip("no /proc/meminfo here")
    config = {**json.loads((tiny / "config.json").read_text()), "num_hidden_layers": 1}  # the layer it holds
    hidden = config["hidden_size"]
    rows = limit[0] // hidden  # bf16: 2 bytes each, so twice the limit
    model = sparse_checkpoint(tmp_path / "huge", config, {"model.layers.0.mlp.down_proj.weight": [rows, hidden]})
    proc = quantkit("gptq", model, tmp_path / "out", "--device", "cpu", *SMALL)
    assert proc.returncode == 1, proc.stderr
    assert "of host memory for gptq" in proc.stderr and "RAM and swap allow" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))
    assert "--num-gpus 2 or more" in proc.stderr  # the way llm-compressor can still make it: offload to disk
    # and that way is not refused: the distributed load spills what does not fit in RAM to disk
    r = recipe.Recipe.model_validate({"model": {"source": str(model)}, "output": str(tmp_path / "out"),
                                      "quantize": {"method": "gptq"}, "runtime": {"num_gpus": 2}})
    check_host_memory(r, r.quantize, source.resolve(r.model))


def test_fp8_static_of_a_model_larger_than_ram_fits_where_its_own_memory_does(tmp_path: Path, tiny: Path) -> None:
    """A checkpoint of 1.5 times RAM and swap: FP8 static only observes the weights, which stay in the source's
    mapped pages (page cache the kernel takes back and reads again a layer at a time), and holds of its own only
    its FP8 copy (8.8 bits a weight: 0.83 times the limit), so it is not refused; GPTQ rewrites every weight into
    its own memory and is. Both checked before a weight is read."""
    from quantkit import recipe, source
    from quantkit.errors import HostMemoryError
    from quantkit.plan import check_host_memory, host_limit

    limit = host_limit()
    if limit is None:
        pytest.skip("no /proc/meminfo here")
    config = {**json.loads((tiny / "config.json").read_text()), "num_hidden_layers": 1}
    hidden = config["hidden_size"]
    model = sparse_checkpoint(tmp_path / "big", config,
                              {"model.layers.0.mlp.down_proj.weight": [limit[0] * 3 // 4 // hidden, hidden]})

    def check(method: dict[str, str]) -> None:
        r = recipe.Recipe.model_validate({"model": {"source": str(model)}, "output": str(tmp_path / "out"),
                                          "quantize": method, "runtime": {"device": "cpu"}})
        check_host_memory(r, r.quantize, source.resolve(r.model))

    check({"method": "fp8", "scheme": "static"})
    with pytest.raises(HostMemoryError, match="of host memory for gptq"):
        check({"method": "gptq"})


def test_existing_output_refused_without_force(tmp_path: Path, tiny: Path) -> None:
    out = tmp_path / "rtn"
    quantkit("rtn", tiny, out, check=True)
    before = read_manifest(out).created
    proc = quantkit("rtn", tiny, out)
    assert proc.returncode == 2 and "already exists" in proc.stderr and "--force" in proc.stderr
    assert read_manifest(out).created == before
    quantkit("rtn", tiny, out, "--force", check=True)
    assert integrity.verify(out).ok


@pytest.mark.cli
def test_corrupt_checkpoint_refused_before_calibration(tmp_path: Path, tiny: Path) -> None:
    bad = tmp_path / "model"
    shutil.copytree(tiny, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 4096])
    t = time.perf_counter()
    proc = quantkit("gptq", bad, tmp_path / "out", *SMALL)
    assert proc.returncode == 2 and "truncated" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
    assert time.perf_counter() - t < 60  # refused by the header check, not after calibrating


def _interrupt_mid_calibration(tmp_path: Path, tiny: Path, sig: int) -> None:
    out = tmp_path / "gptq"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "gptq", str(tiny), str(out), "--samples", "64",
                             "--seq-len", "512"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines: list[str] = []
    calibrating = threading.Event()

    def read_stdout() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "Loading" in line:  # the model is loaded: the next step is calibration
                calibrating.set()

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    assert calibrating.wait(300), "the run never reached calibration: " + "".join(lines)
    assert list(tmp_path.glob(".gptq.partial-*")), "no temporary output while calibrating"
    time.sleep(1)
    proc.send_signal(sig)
    err = proc.stderr.read()  # type: ignore[union-attr]
    proc.wait(timeout=120)
    reader.join(timeout=10)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted" in err
    assert not any("Quantizing" in line for line in lines), "the run finished calibrating before the signal"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "partial output or lock left behind"


def test_ctrl_c_mid_calibration_cleans_up(tmp_path: Path, tiny: Path) -> None:
    _interrupt_mid_calibration(tmp_path, tiny, signal.SIGINT)


def test_sigterm_mid_calibration_cleans_up(tmp_path: Path, tiny: Path) -> None:
    _interrupt_mid_calibration(tmp_path, tiny, signal.SIGTERM)


SWALLOWED_INTERRUPT = """
import os, signal, sys, time
from pathlib import Path
from quantkit import interrupts
from quantkit.artifact import ArtifactWriter

interrupts.install()


class Finalizer:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # lands while __del__ runs: Python prints "Exception ignored" and goes on
        for _ in range(200_000):
            pass


try:
    Finalizer()
    time.sleep(5)
    print("lost")
except KeyboardInterrupt as e:
    print("delivered:", e)
out = Path(sys.argv[1])
try:
    with ArtifactWriter(out) as w:
        (w.path / "weights.bin").write_bytes(b"x")
        w.commit({})
    print("published")
except KeyboardInterrupt:
    print("refused")
"""


def test_interrupt_swallowed_by_a_finalizer_still_stops_the_run(tmp_path: Path) -> None:
    """A Ctrl-C that lands in a ``__del__`` is re-delivered, and no artifact is sealed after it."""
    proc = subprocess.run([sys.executable, "-c", SWALLOWED_INTERRUPT, str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split("\n")[:2] == ["delivered: stopped by SIGINT", "refused"], proc.stdout + proc.stderr
    assert "Exception ignored" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_second_run_on_the_same_output_is_refused(tmp_path: Path, tiny: Path) -> None:
    out = tmp_path / "gptq"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.Popen([sys.executable, "-m", "quantkit", "gptq", str(tiny), str(out), "--samples", "64",
                              "--seq-len", "512"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not list(tmp_path.glob(".gptq.lock")) and time.time() < deadline:
            time.sleep(0.2)
        second = quantkit("gptq", tiny, out, *SMALL)
        assert second.returncode == 2 and "another quantkit process" in second.stderr
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_same_recipe_seed_and_versions_give_identical_bytes(tmp_path: Path, tiny: Path, method: str) -> None:
    """Two runs, the first on an empty cache and the second reusing its calibration tokens, give the same bytes and
    the same calibration record but for the reuse itself. Its own cache: on the shared one, whether the first run
    tokenized depended on which test ran before it, and the record's ``tokens_reused`` differed only then."""
    a, b = tmp_path / "a", tmp_path / "b"
    calibration = SMALL if method == "gptq" else []  # rtn reads no calibration data, and takes no such flags
    env = {"QUANTKIT_CACHE_DIR": str(tmp_path / "cache")}
    quantkit(method, tiny, a, *calibration, "--device", "cpu", env=env, check=True)
    quantkit(method, tiny, b, *calibration, "--device", "cpu", env=env, check=True)
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma.files == mb.files and ma.output_sha256 == mb.output_sha256  # every file's sha256 identical
    if method == "rtn":
        assert ma.calibration is None and mb.calibration is None
        return
    assert (ma.calibration.tokens_reused, mb.calibration.tokens_reused) == (False, True)
    assert ma.calibration.model_copy(update={"tokens_reused": True}) == mb.calibration


def _sealed(out: Path) -> Path:
    """A small artifact folder sealed by quantkit's own writer (nothing to quantize: publish reads only files)."""
    source = SourceInfo(id="models/quantkit-tiny", path=str(ROOT / "models" / "quantkit-tiny"),
                                 config_sha256="0" * 64)
    with artifact.ArtifactWriter(out) as w:
        (w.path / "model.safetensors").write_bytes(b"weights")
        w.commit(Manifest(kind="test", method="test", source=source))
    return out


def _closed_port() -> int:
    """A loopback port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.cli
def test_publish_refuses_in_one_line_what_it_can_check_before_the_hub(tmp_path: Path) -> None:
    """A bad repository id, then no token, each exit 2 before any request; a hub that cannot be reached, exit 1.
    Each was a traceback (httpx.ConnectError, HFValidationError) or no check at all."""
    art = _sealed(tmp_path / "art")
    no_hub = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    no_token = {**no_hub, "HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN_PATH": str(tmp_path / "hf-home" / "token"),
                "HF_TOKEN": "", "HUGGING_FACE_HUB_TOKEN": "", "HF_OIDC_RESOURCE": ""}
    cases = [(["publish", tmp_path / "missing", "--repo", "bad name!!"], no_hub, 2, "not a Hugging Face repository id"),
             (["publish", art, "--repo", "me/test"], no_token, 2, "hf auth login"),
             (["publish", art, "--repo", "me/test"], {**no_hub, "HF_TOKEN": "hf_test"}, 1, "cannot reach the Hugging")]
    for argv, env, code, said in cases:
        for json_flag in ([], ["--json"]):
            proc = quantkit(*argv, *json_flag, env=env, timeout=120)
            assert proc.returncode == code and said in proc.stderr, proc.stderr
            assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 2, proc.stderr
            if json_flag:  # as every verb under --json: the error is also stdout's one document
                doc = json.loads(proc.stdout)
                assert doc["ok"] is False and doc["exit_code"] == code and said in doc["error"] + (doc["hint"] or "")
            else:
                assert proc.stdout == ""
    assert integrity.verify(art).ok
