"""bench/project.py: the 70B and 405B projection from runs of the 70B width with 4 and 8 layers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import project  # noqa: E402

pytestmark = pytest.mark.unit


def run(layers: int, gpu: float = 20e9) -> dict:
    """A quantize_cost run of ``layers`` layers: 100 s fixed + 10 s per layer, 30 GB + 2 GB of RSS per layer."""
    return {"rc": 0, "wall_s": 100 + 10 * layers, "quantize_s": 8 * layers, "peak_rss_bytes": 30e9 + 2e9 * layers,
            "peak_anon_rss_bytes": 10e9 + 1e9 * layers, "output_bytes": 2e9 + 0.5e9 * layers, "peak_gpu_bytes": gpu}


def test_fit_separates_what_grows_per_layer() -> None:
    f = project.fit(run(4), run(8, gpu=21e9))
    assert f["per_layer"]["wall_s"] == 10 and f["fixed"]["wall_s"] == 100
    assert f["per_layer"]["peak_anon_rss_bytes"] == 1e9 and f["peak_gpu_bytes"] == 21e9


def test_70b_is_the_measured_width_times_80_and_405b_scales_up() -> None:
    f = project.fit(run(4), run(8))
    r70 = project.project(f, "70b", "gptq", 32, 2048)
    assert r70["layer_time_ratio"] == 1 and r70["wall_s"] == 100 + 80 * 10
    assert r70["peak_rss_bytes"] == 30e9 + 80 * 2e9 and r70["source_bytes"] == 2 * 70_552_387_584
    r405 = project.project(f, "405b", "gptq", 32, 2048)
    assert 3.5 < r405["layer_size_ratio"] < 4.5  # 16384 x 53248 against 8192 x 28672, and wider attention
    assert r405["wall_s"] > 100 + 126 * 10 * r405["layer_size_ratio"] * 0.9  # FLOPs grow at least as the weights do
    assert r405["disk_bytes"] > 800e9


def test_cli_writes_the_tables(tmp_path: Path) -> None:
    for name, layers in (("short", 4), ("long", 8)):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"samples": 32, "seq_len": 2048, "machine": {"cpu": "x", "cores": 16, "memory_bytes": 126 * 2**30},
             "runs": {"gptq": {"quantkit": run(layers)},
                                                      "awq": {"quantkit": {"rc": 1}}}}))
    subprocess.run([sys.executable, str(ROOT / "bench" / "project.py"), "--short", str(tmp_path / "short.json"),
                    "--long", str(tmp_path / "long.json"), "--results-dir", str(tmp_path)], check=True,
                   capture_output=True)
    md = (tmp_path / "project_70b.md").read_text()
    assert "| 70b | gptq | 15 min |" in md and "awq" not in md  # a failed run is never projected
    assert "190 GB of RAM needed, 126 GiB there" in md  # 30 GB + 80 x 2 GB against the measuring host's RAM
