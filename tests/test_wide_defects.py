"""What bench/wide.py got wrong on a real H100 (80 GB GPU, 125 GiB of host memory, 68.5 GB of free disk under the
work folder, 128 GiB of /dev/shm) with the full 32B shape and GPTQ: a disk plan below what quantkit's own free-space
check asks, so quantkit refused its output after the build; a second call, with the source built, that started a
case whose output the disk could not hold; a serve case whose artifact was missing that ended the script with a
traceback; and an H100 named h200. Planned on the CPU from header-only checkpoints, the machine's figures given."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import wide  # noqa: E402

pytestmark = pytest.mark.cli

GB, GIB = 1e9, 2**30
H100_DISK = 68_500_000_000  # free under the work folder when the plan was made


def h100(workdir: Path, disk: int, *more: str) -> list[str]:
    """bench/wide.py's arguments for the 32B's GPTQ on the H100's figures, ``disk`` bytes of it free."""
    return ["--shapes", "32b", "--methods", "gptq", "--workdir", str(workdir), "--gpus", "1", "--gpu-bytes", "80e9",
            "--host-bytes", str(125 * GIB), "--disk-bytes", str(disk), "--shm-bytes", str(128 * GIB), "--dry-run",
            *more]


def free_disk(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """The free disk quantkit's check reads, as the machine would have it."""
    from quantkit import artifact

    monkeypatch.setattr(artifact.shutil, "disk_usage", lambda _: SimpleNamespace(total=free, used=0, free=free))


def test_an_output_is_planned_at_what_quantkits_free_space_check_asks(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The H100 planned 68.3 GB of disk (4 shards, 19.5 GB, in /dev/shm) and after the build had 20.9 GB free, 1.6 GB
    less than planned for the work folder's other files; quantkit then refused GPTQ's output for want of 20.8 GiB.
    Now an output's figure is exactly what quantkit's check asks (it passes with that much free, not with a byte
    less), and the same machine's plan takes more shards into /dev/shm, so the check passes after the build even
    with those 1.6 GB gone."""
    from quantkit.artifact import check_free_space
    from quantkit.errors import DiskSpaceError

    args = wide.parse(h100(tmp_path, H100_DISK, "--no-serve"))
    m = wide.machine(args)
    cases = {c.name: c for c in wide.cases(args, m)}
    assert not [c.skip for c in cases.values() if c.skip]
    build, gptq = cases["32b/build"], cases["32b/gptq/quantkit"]
    planned = wide.plan_outputs("32b", args)["gptq"]["disk_bytes"]  # what quantkit gptq asks its check about
    assert cases["32b/gptq/llm-compressor"].disk_bytes == gptq.disk_bytes > planned
    free_disk(monkeypatch, gptq.disk_bytes)
    check_free_space(tmp_path, planned)
    free_disk(monkeypatch, gptq.disk_bytes - 1)
    with pytest.raises(DiskSpaceError, match="not enough free space"):
        check_free_space(tmp_path, planned)
    shards = sorted((tmp_path / "header-32b").glob("model-*.safetensors"))
    source = sum(f.stat().st_size for f in shards)
    count = int(build.command[-1])
    assert count > 4 and build.shm_bytes == sum(f.stat().st_size for f in shards[:count])
    assert build.shm_bytes <= m.shm_bytes - wide.SHM_RESERVE
    free_disk(monkeypatch, H100_DISK - (source - build.shm_bytes) - 1_600_000_000)  # the disk after the build
    check_free_space(tmp_path, planned)


def test_a_quantize_case_whose_output_the_free_disk_cannot_hold_beside_a_built_source_is_skipped(
        tmp_path: Path) -> None:
    """``--only '32b/gptq/*'`` after a build-only call, 20.9 GB free: each GPTQ case is skipped in one line that says
    what its output needs and what the disk has, before it starts, and the cases reading quantkit's artifact with it;
    with that much free, they run."""
    src = tmp_path / "src-32b"
    src.mkdir()
    (src / "bench-config.json").write_text("{}")  # built: its stamp (and no shard to look for)
    args = wide.parse(h100(tmp_path, 20_900_000_000, "--only", "32b/gptq/*"))
    m = wide.machine(args)
    cases = {c.name: c for c in wide.cases(args, m)}
    assert cases["32b/build"].skip == "the source is already built (--only left it out)"
    need = cases["32b/gptq/quantkit"].disk_bytes + wide.DISK_MARGIN
    for tool in ("llm-compressor", "quantkit"):
        c = cases[f"32b/gptq/{tool}"]
        assert c.skip == (f"disk: the output needs {need / GB:.1f} GB free beside the built source "
                          f"({c.disk_bytes / GB:.1f} GB that quantkit's free-space check asks for it, "
                          f"{wide.DISK_MARGIN / GB:.1f} GB for the work folder's other files), {tmp_path} has 20.9 GB "
                          "free"), tool
    assert cases["32b/gptq/serve-tp1"].skip == "quantkit's artifact of it is not made in this run"
    enough = wide.parse(h100(tmp_path, need, "--only", "32b/gptq/*"))
    ran = {c.name: c.skip for c in wide.cases(enough, wide.machine(enough))}
    assert ran["32b/gptq/llm-compressor"] == ran["32b/gptq/quantkit"] == ran["32b/gptq/serve-tp1"] == ""


def test_a_case_whose_checkpoint_is_missing_is_recorded_and_passed_over(tmp_path: Path) -> None:
    """GPTQ's quantization failed, so its artifact is not there: smoke, serve and eval each record it and return (the
    serve case raised FileNotFoundError and ended the script before the bf16 serve); a missing source likewise."""
    args = wide.parse(["--shapes", "32b", "--methods", "gptq", "--tp", "1,2", "--workdir", str(tmp_path)])
    inputs = {"src": tmp_path / "src-32b", "calib": tmp_path / "calib.jsonl.gz", "tokens": tmp_path / "tokens.json"}
    gone = {"rc": None, "error": f"{tmp_path / 'out-32b-gptq-quantkit'} is not there (its quantization failed)"}
    assert wide.run_serve(wide.Case("32b/gptq/serve-tp1", "serve", "32b", "gptq"), args, inputs) == gone
    assert wide.run_engine(wide.Case("32b/gptq/eval-tp2", "eval", "32b", "gptq", tp=2), args, inputs) == gone
    assert wide.run_engine(wide.Case("32b/gptq/smoke-tp1", "smoke", "32b", "gptq"), args, inputs) == gone
    assert wide.run_serve(wide.Case("32b/bf16/serve-tp1", "serve", "32b"), args, inputs) == \
        {"rc": None, "error": f"{inputs['src']} is not there (the build failed)"}


@pytest.mark.parametrize(("smi", "name"), [
    (["NVIDIA H100 80GB HBM3, 81559 MiB"], "h100"),
    (["NVIDIA H100 80GB HBM3, 81559 MiB"] * 2, "h100x2"),
    (["NVIDIA H200, 143771 MiB"] * 4, "h200x4"),
    ([], "h200"),
])
def test_the_machine_is_named_by_its_gpu_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smi: list[str],
                                               name: str) -> None:
    """The H100 was named h200 (results titled "32b on h200", filed under bench/results/h200): the name is now
    nvidia-smi's GPU model and count, h200 still where no GPU is visible; the reference machines keep theirs."""
    monkeypatch.setattr(wide.meta, "gpus", lambda: smi)
    m = wide.machine(wide.parse(["--workdir", str(tmp_path)]))
    assert (m.name, m.gpus) == (name, max(len(smi), 1))
    assert wide.machine(wide.parse(["--workdir", str(tmp_path), "--machine", "h200x2"])).name == "h200x2"
