"""What bench/wide.py got wrong on a real H100 (80 GB GPU, 125 GiB of host memory, 68.5 GB of free disk under the
work folder, 128 GiB of /dev/shm) with the full 32B shape and GPTQ: a disk plan below what quantkit's own free-space
check asks, so quantkit refused its output after the build; a second call, with the source built, that started a
case whose output the disk could not hold; a serve case whose artifact was missing that ended the script with a
traceback; an H100 named h200; its decode shares taken against the H200's bandwidth; FP8 static's host memory
counted with the source's /dev/shm shards twice; the cases after a failed build run against a missing source; a
failed smoke's error shown as its chat answer and a refused run checked against the plan. Planned on the CPU from
header-only checkpoints, the machine's figures given; a case that runs a process runs the real one (a build that
fails, quantkit refusing a missing source), and vLLM's measurement is given as its worker reports one. Found in
review since: a failed run's error taken as its log's last line (quantkit's hint); the H200's bandwidth assumed
for a decode limit where no GPU is seen; a failed eval's error left out of the README's eval table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import serve_speed  # noqa: E402
import step_bytes  # noqa: E402
import wide  # noqa: E402

pytestmark = pytest.mark.cli

GB, GIB = 1e9, 2**30
H100_DISK = 68_500_000_000  # free under the work folder when the plan was made


def h100(workdir: Path, disk: int, *more: str) -> list[str]:
    """bench/wide.py's arguments for the 32B's GPTQ on the H100's figures, ``disk`` bytes of it free."""
    return ["--shapes", "32b", "--methods", "gptq", "--workdir", str(workdir), "--gpus", "1", "--gpu-bytes", "80e9",
            "--host-bytes", str(125 * GIB), "--disk-bytes", str(disk), "--shm-bytes", str(128 * GIB), "--dry-run",
            *more]


def test_an_output_is_planned_at_what_quantkits_free_space_check_asks(tmp_path: Path) -> None:
    """The H100 planned 68.3 GB of disk (4 shards, 19.5 GB, in /dev/shm) and after the build had 20.9 GB free, 1.6 GB
    less than planned for the work folder's other files; quantkit then refused GPTQ's output for want of 20.8 GiB.
    Now an output's figure is exactly what quantkit's check asks (it passes with that much free, not with a byte
    less), and the same machine's plan takes more shards into /dev/shm, so the check passes after the build even
    with those 1.6 GB gone."""
    from quantkit.artifact import free_space_asked

    args = wide.parse(h100(tmp_path, H100_DISK, "--no-serve"))
    m = wide.machine(args)
    cases = {c.name: c for c in wide.cases(args, m)}
    assert not [c.skip for c in cases.values() if c.skip]
    build, gptq = cases["32b/build"], cases["32b/gptq/quantkit"]
    planned = wide.plan_outputs("32b", args)["gptq"]["disk_bytes"]  # what quantkit gptq asks its check about
    assert cases["32b/gptq/llm-compressor"].disk_bytes == gptq.disk_bytes == free_space_asked(planned) > planned
    shards = sorted((tmp_path / "header-32b").glob("model-*.safetensors"))
    source = sum(f.stat().st_size for f in shards)
    count = int(build.command[-1])
    assert count > 4 and build.shm_bytes == sum(f.stat().st_size for f in shards[:count])
    assert build.shm_bytes <= m.shm_bytes - wide.SHM_RESERVE
    assert free_space_asked(planned) <= H100_DISK - (source - build.shm_bytes) - 1_600_000_000  # after the build


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
def test_the_machine_is_named_by_its_gpu_model(tmp_path: Path, smi: list[str], name: str) -> None:
    """The H100 was named h200 (results titled "32b on h200", filed under bench/results/h200): the name is now
    nvidia-smi's GPU model and count, h200 still where no GPU is visible; the reference machines keep theirs."""
    assert wide.machine_name(smi) == name
    assert wide.machine(wide.parse(["--workdir", str(tmp_path), "--machine", "h200x2"])).name == "h200x2"


@pytest.mark.parametrize(("gpu", "bandwidth"), [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H200", 4.8e12),
                                                ("NVIDIA H100 PCIe", None), ("NVIDIA A100-SXM4-80GB", None)])
def test_the_decode_limit_is_against_the_serving_gpus_bandwidth(tmp_path: Path, gpu: str,
                                                                bandwidth: float | None) -> None:
    """On the H100, wide.py's serve case gave serve_speed the H200's 4.8 TB/s, so its shares of the limit were
    against another card. The limit is now the serving GPU's (as vLLM's process names it in its measurement), the
    figure and whose it is in the row; a GPU bench/meta.py's table lacks (an H100 PCIe is an "h100" too, at 2.0
    TB/s) gets none, and the table says "-" for it. A measurement as vLLM's worker reports it, its figures the H100's
    32B GPTQ run's."""
    from quantkit.engines.vllm import kernels

    src = ROOT / "models" / "quantkit-tiny"
    sb = step_bytes.count(src)
    config = kernels.configurations(kernels.read_quantization(src))[0]
    m = kernels.Measurement(config, "ok", ttft_s=0.05, decode_tok_s={"1": 83.2, "16": 1246.0}, seconds=60.0,
                            log=str(tmp_path / "vllm.log"), extra={"gpu": gpu})
    row = serve_speed.measured(serve_speed.checkpoint_row(src, sb, 1), m, sb, 1, [1, 16], None)
    read = sb.read(1)
    assert row["bandwidth"] == bandwidth and row["bandwidth_of"].startswith(gpu)
    if bandwidth is None:
        assert row["limit_b1"] is row["limit_b16"] is row["b1"]["share_of_limit"] is None
        assert row["bandwidth_of"] == f"{gpu}, not in bench/meta.py's BANDWIDTH: no limit known"
    else:
        assert row["limit_b1"] == pytest.approx(bandwidth / read)
        assert row["b1"]["share_of_limit"] == pytest.approx(83.2 * read / bandwidth)
    data = {"command": "serve_speed.py", "date": "2026-12-06", "machine": {"cpu": "x", "cores": 16}, "versions": {},
            "prompt_len": 512, "gen": 128, "batches": [1, 16], "rows": [row]}
    line = next(ln for ln in serve_speed.markdown(data).splitlines() if ln.startswith("| bf16 |"))
    assert line.endswith(" | 83 | - | 1246 | - |" if bandwidth is None else
                         f" | 83 ({83.2 * read / bandwidth:.0%}) | {bandwidth / read:.0f} | "
                         f"1246 ({1246 * read / (16 * bandwidth):.0%}) | {16 * bandwidth / read:.0f} |")


def test_the_bandwidth_is_given_or_the_serving_gpus() -> None:
    """``--bandwidth`` wins; else the GPU that served (vLLM's name for it, else nvidia-smi's first: wide.py's machine
    reads the same name); no GPU seen at all: none (test_no_gpu_seen_gives_no_decode_limit)."""
    assert serve_speed.limit_bandwidth(2e12, "NVIDIA H200") == (2e12, "--bandwidth")
    assert serve_speed.limit_bandwidth(None, "NVIDIA H100 80GB HBM3") == (3.35e12, "NVIDIA H100 80GB HBM3")


def test_the_shm_source_is_off_the_host_for_every_method_and_fp8_static_fits_beside_it(tmp_path: Path) -> None:
    """The whole 32B source in /dev/shm (45 GB of disk free), the H100's 125 GiB of host memory, 96 x 2048 calibration
    tokens: the tmpfs pages cannot leave RAM, so every case has the host less them (68.7 GB). FP8 static only
    observes the weights, so its plan counts its FP8 copy and the activations, not the source it maps (30.5 GiB of
    its own beside the source on the H100): it fits. GPTQ rewrites every weight into its own memory, then builds its
    int4 copy: refused in one line. Before, FP8's figure counted the mapped source (69.6 GB) and it was checked
    against the whole host instead."""
    args = wide.parse(h100(tmp_path, 45_000_000_000, "--methods", "gptq,fp8-static", "--samples", "96", "--no-serve"))
    m = wide.machine(args)
    cases = {c.name: c for c in wide.cases(args, m)}
    build = cases["32b/build"]
    assert build.shm_bytes == sum(f.stat().st_size for f in (tmp_path / "header-32b").glob("model-*.safetensors"))
    beside = m.host_bytes - build.shm_bytes
    for tool in ("llm-compressor", "quantkit"):
        fp8, gptq = cases[f"32b/fp8-static/{tool}"], cases[f"32b/gptq/{tool}"]
        assert fp8.host_bytes < beside and fp8.skip == "", (fp8.host_bytes / GB, fp8.skip)
        assert gptq.host_bytes > build.shm_bytes  # the whole model of its own, and the int4 copy
        assert gptq.skip == (f"host memory: the plan's floor is {gptq.host_bytes / GB:.1f} GB, the machine allows "
                             f"{beside / GB:.1f} GB beside the source's {build.shm_bytes / GB:.1f} GB in /dev/shm")


def test_a_failed_build_skips_its_shapes_cases_and_the_next_shape_goes_on(tmp_path: Path) -> None:
    """Both builds fail (rc 1: a file stands where each source folder would be made): no quantize case runs against
    the missing source, each says in one line which build failed and its rc, and the second shape's build is still
    tried. bench/wide.py runs as it would, in its own process."""
    for shape in ("tiny", "small"):
        (tmp_path / f"src-{shape}").write_text("not a folder")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "wide.py"), "--shapes", "tiny,small", "--methods",
                           "gptq", "--no-serve", "--workdir", str(tmp_path), "--results-dir", str(tmp_path / "res"),
                           "--gpus", "1", "--gpu-bytes", "80e9", "--host-bytes", "1e12", "--disk-bytes", "1e13",
                           "--shm-bytes", "1e12"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cases = {c["name"]: c for c in json.loads((tmp_path / "res" / "results.json").read_text())["cases"]}
    for shape in ("tiny", "small"):
        assert cases[f"{shape}/build"]["result"]["rc"] == 1
        for tool in ("llm-compressor", "quantkit"):
            assert cases[f"{shape}/gptq/{tool}"]["skip"] == f"{shape}/build failed (rc 1): no source"
            assert "result" not in cases[f"{shape}/gptq/{tool}"] or not cases[f"{shape}/gptq/{tool}"]["result"]
    assert "   tiny/build failed (rc 1): its shape's 2 case(s) skipped" in proc.stdout
    assert "- small/gptq/quantkit: small/build failed (rc 1): no source" in (tmp_path / "res" / "README.md").read_text()


def test_a_failed_smoke_shows_its_error_and_a_failed_run_is_not_checked_against_the_plan(tmp_path: Path) -> None:
    """The H100's README showed a missing artifact's error in the chat answer column, and a quantkit run refused in
    1.4 s "plan-checked" at +58850%: the error now has its own column, and a run whose rc is not 0 has no plan check
    (its error is quantkit's ``error:`` line, not the hint under it that ends the log). Here quantkit itself refuses,
    in its own process: its source is not there."""
    args = wide.parse(["--shapes", "32b", "--methods", "gptq", "--workdir", str(tmp_path)])
    args.logs.mkdir(parents=True)
    quantize = wide.Case("32b/gptq/quantkit", "quantize", "32b", "gptq", "quantkit", host_bytes=84_033_732_665,
                         gpu_bytes=18_310_603_008)
    inputs = {"src": tmp_path / "src-32b", "calib": tmp_path / "calib.jsonl.gz", "tokens": tmp_path / "tokens.json"}
    quantize.result = wide.run_quantize(quantize, args, inputs)
    said = [ln.strip() for ln in Path(quantize.result["log"]).read_text().splitlines() if ln.strip()]
    assert quantize.result["rc"] not in (0, None) and said[-1].startswith("hint: "), said
    assert quantize.result["error"] == f"error: model path {inputs['src']} does not exist"
    assert "plan" not in quantize.result
    smoke = wide.Case("32b/gptq/smoke-tp1", "smoke", "32b", "gptq")
    smoke.result = wide.run_engine(smoke, args, inputs)
    data = {"command": "wide.py", "date": "2026-12-06", "machine": {"cpu": "x", "cores": 16}, "versions": {},
            "plan": "", "machine_name": "h100", "shapes": ["32b"], "batches": [1, 16], "tp": [1], "eval_tokens": 2048}
    wide.save(data, [quantize, smoke], tmp_path / "res")
    lines = (tmp_path / "res" / "README.md").read_text().splitlines()
    assert next(ln for ln in lines if ln.startswith("| 32b/gptq/quantkit |")).endswith(" | - | - | 0.0 GB |")
    gone = f"{tmp_path / 'out-32b-gptq-quantkit'} is not there (its quantization failed)"
    assert "| smoke | rc | greedy completion | chat answer | error |" in lines
    assert f"| 32b/gptq/smoke-tp1 | - | - | - | `{gone!r}` |" in lines


def test_a_smoke_refused_before_any_run_shows_quantkits_error(tmp_path: Path) -> None:
    """A smoke that quantkit refuses before it starts any server (here the artifact's manifest is not JSON) answers
    ``ok: false`` with its error and no runs: the error column showed nothing, as the error was read from the runs
    alone."""
    args = wide.parse(["--shapes", "32b", "--methods", "gptq", "--workdir", str(tmp_path)])
    args.logs.mkdir(parents=True)
    art = tmp_path / "out-32b-gptq-quantkit"
    art.mkdir()
    (art / "config.json").write_text("{}")
    (art / "quantkit.json").write_text("not a manifest")
    smoke = wide.Case("32b/gptq/smoke-tp1", "smoke", "32b", "gptq")
    result = wide.run_engine(smoke, args, {"src": tmp_path / "src-32b"})
    assert result["rc"] not in (0, None) and result["smoke"]["ok"] is False and not result["smoke"].get("runs")
    assert result["error"].startswith(f"{art / 'quantkit.json'} is unreadable or not JSON"), result


# A real torchrun's stderr (torch 2.13, two ranks of a script raising torch.OutOfMemoryError), as bench/wide.py's log
# of a direct llm-compressor run under ``--num-gpus 2`` holds it: the ranks' tracebacks, then the launcher's own,
# whose ChildFailedError names no cause. Site-packages and the interpreter are written SITE and PYTHON, and the
# lines longer than this file allows are split; nothing else is changed.
TORCHRUN_LOG = "\n".join([
    '',
    '*****************************************',
    'Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid'
    ' your system being overloaded, please further tune the variable for optimal performance in'
    ' your application as needed. ',
    '*****************************************',
    'Traceback (most recent call last):',
    '  File "/tmp/fail.py", line 2, in <module>',
    '    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")',
    'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB',
    'Traceback (most recent call last):',
    '  File "/tmp/fail.py", line 2, in <module>',
    '    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")',
    'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB',
    'W1206 14:53:50.487000 26986 torch/distributed/elastic/multiprocessing/api.py:1028] Sending'
    ' process 27000 closing signal SIGTERM',
    'E1206 14:53:50.520000 26986 torch/distributed/elastic/multiprocessing/api.py:1002] failed'
    ' (exitcode: 1) local_rank: 1 (pid: 27001) of binary: PYTHON',
    'Traceback (most recent call last):',
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    '  File "<frozen runpy>", line 88, in _run_code',
    '  File "SITE/torch/distributed/run.py", line 1032, in <module>',
    '    main()',
    '  File "SITE/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper',
    '    return f(*args, **kwargs)',
    '           ^^^^^^^^^^^^^^^^^^',
    '  File "SITE/torch/distributed/run.py", line 1028, in main',
    '    run(args)',
    '  File "SITE/torch/distributed/run.py", line 1019, in run',
    '    elastic_launch(',
    '  File "SITE/torch/distributed/launcher/api.py", line 194, in __call__',
    '    return launch_agent(',
    '           ^^^^^^^^^^^^^',
    '  File "SITE/torch/distributed/launcher/api.py", line 383, in launch_agent',
    '    raise ChildFailedError(',
    'torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ',
    '============================================================',
    '/tmp/fail.py FAILED',
    '------------------------------------------------------------',
    'Failures:',
    '[1]:',
    '  time      : 2026-12-06_14:53:50',
    '  host      : localhost',
    '  rank      : 0 (local_rank: 0)',
    '  exitcode  : -15 (pid: 27000)  (SIGTERM)',
    '  error_file: <N/A>',
    '  traceback : Signal 15 (SIGTERM) received by PID 27000',
    '------------------------------------------------------------',
    'Root Cause (first observed failure):',
    '[0]:',
    '  time      : 2026-12-06_14:53:50',
    '  host      : localhost',
    '  rank      : 1 (local_rank: 1)',
    '  exitcode  : 1 (pid: 27001) ',
    '  error_file: <N/A>',
    '  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html',
    '============================================================',
    '',
])


def test_a_failed_runs_error_is_quantkits_error_line_or_the_exception_raised(tmp_path: Path) -> None:
    """A failed run's error was its log's last line: for quantkit its hint, under the ``error:`` line that says what
    went wrong; for a Python program whatever it printed after its traceback (an atexit handler's line, torchrun's
    report). Now it is quantkit's ``error:`` line, else the exception of the last traceback (torchrun's
    ChildFailedError, which names no cause, passed over for its rank's), else the last line. Each log here is a real
    process's stderr, run alongside one another (about a second in all)."""
    atexit = "import atexit, sys; atexit.register(print, 'flushing peak.json', file=sys.stderr); 1 / 0"
    chained = "try:\n    {}['calib']\nexcept KeyError:\n    raise RuntimeError('no calibration set')"
    argvs = {"quantkit": [sys.executable, "-m", "quantkit", "awq", "/nonexistent", str(tmp_path / "out")],
             "atexit": [sys.executable, "-c", atexit], "chained": [sys.executable, "-c", chained],
             "exit": [sys.executable, "-c", "raise SystemExit('no GPU visible: nothing to measure')"]}
    procs = {k: subprocess.Popen(v, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
             for k, v in argvs.items()}
    logs = {k: p.communicate(timeout=120)[1] for k, p in procs.items()}
    assert all(p.returncode != 0 for p in procs.values())
    said = [ln.strip() for ln in logs["quantkit"].splitlines() if ln.strip()]
    assert said == ["error: model path /nonexistent does not exist",
                    "hint: give a local checkpoint folder or a hub id like org/name"]
    assert wide.failure_line(logs["quantkit"]) == "error: model path /nonexistent does not exist"
    assert logs["atexit"].rstrip().endswith("flushing peak.json")
    assert wide.failure_line(logs["atexit"]) == "ZeroDivisionError: division by zero"
    assert wide.failure_line(logs["chained"]) == "RuntimeError: no calibration set"
    assert wide.failure_line(logs["exit"]) == "no GPU visible: nothing to measure"
    assert wide.failure_line(TORCHRUN_LOG) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert wide.failure_line("") == ""


def test_with_no_gpu_seen_the_plan_says_whose_gpu_memory_it_took(tmp_path: Path) -> None:
    """Planning an H100 from a machine without a GPU (``--gpu-bytes 85e9``) printed "planned for one H200 (141.0 GB)"
    beside the 85.0 GB it planned for: it says the memory given, and an H200's only where it assumed it."""
    if wide.meta.gpus():
        pytest.skip("nvidia-smi lists a GPU here: the plan takes its memory")
    given = wide.machine(wide.parse(["--gpu-bytes", "85e9", "--workdir", str(tmp_path)]))
    assumed = wide.machine(wide.parse(["--workdir", str(tmp_path)]))
    assert (given.gpu_bytes, given.said[-1]) == (85e9, "no GPU visible: planned for the GPU memory given")
    assert assumed.gpu_bytes == wide.H200_GPU_BYTES
    assert assumed.said[-1] == "no GPU visible: planned for an H200's 141.0 GB"


def test_no_gpu_seen_gives_no_decode_limit(tmp_path: Path) -> None:
    """Where no GPU is seen (vLLM's process named none and nvidia-smi lists none) the limit was the H200's 4.8 TB/s,
    assumed; there is no serving GPU to take a bandwidth from, so the limit and the share are None and the markdown
    says why. Through serve_speed.measured on a measurement as vLLM's worker reports one without a GPU's name, on a
    machine where nvidia-smi lists none (this CI's)."""
    from quantkit.engines.vllm import kernels

    assert serve_speed.limit_bandwidth(None, None) == (None, "no GPU seen: no limit known")
    if serve_speed.meta.gpus():
        pytest.skip("nvidia-smi lists a GPU here: its bandwidth is the serving GPU's")
    src = ROOT / "models" / "quantkit-tiny"
    sb = step_bytes.count(src)
    config = kernels.configurations(kernels.read_quantization(src))[0]
    m = kernels.Measurement(config, "ok", ttft_s=0.05, decode_tok_s={"1": 83.2, "16": 1246.0}, seconds=60.0,
                            log=str(tmp_path / "vllm.log"), extra={})
    row = serve_speed.measured(serve_speed.checkpoint_row(src, sb, 1), m, sb, 1, [1, 16], None)
    assert (row["bandwidth"], row["bandwidth_of"]) == (None, "no GPU seen: no limit known")
    assert row["limit_b1"] is row["limit_b16"] is row["b1"]["share_of_limit"] is row["b16"]["share_of_limit"] is None
    data = {"command": "serve_speed.py", "date": "2026-12-06", "machine": {"cpu": "x", "cores": 16}, "versions": {},
            "prompt_len": 512, "gen": 128, "batches": [1, 16], "rows": [row]}
    md = serve_speed.markdown(data)
    assert "Limit = batch x the serving GPU's memory bandwidth (no GPU seen: no limit known) / bytes" in md
    assert next(ln for ln in md.splitlines() if ln.startswith("| bf16 |")).endswith(" | 83 | - | 1246 | - |")


def test_a_failed_evals_error_is_in_the_eval_table(tmp_path: Path) -> None:
    """results.json held a failed eval's error (inside quantkit eval's JSON) but the README's eval table showed only
    its rc and dashes: the error now has a column of its own, as the smoke table's, and a top-level ``error`` in the
    result. One eval really runs quantkit eval, in its own process, on an artifact folder it refuses (no vLLM here,
    or a config with nothing in it); the other's artifact is missing."""
    args = wide.parse(["--shapes", "32b", "--methods", "gptq,awq", "--tp", "1,2", "--workdir", str(tmp_path)])
    args.logs.mkdir(parents=True)
    (tmp_path / "out-32b-gptq-quantkit").mkdir()
    (tmp_path / "out-32b-gptq-quantkit" / "config.json").write_text("{}")
    inputs = {"src": tmp_path / "src-32b", "calib": tmp_path / "calib.jsonl.gz", "tokens": tmp_path / "tokens.json"}
    ran = wide.Case("32b/gptq/eval-tp1", "eval", "32b", "gptq", tp=1)
    gone = wide.Case("32b/awq/eval-tp1", "eval", "32b", "awq", tp=1)
    ran.result, gone.result = wide.run_engine(ran, args, inputs), wide.run_engine(gone, args, inputs)
    assert ran.result["rc"] not in (0, None) and ran.result["ppl"] is None
    assert ran.result["error"] == ran.result["eval"]["error"] and ran.result["error"]
    data = {"command": "wide.py", "date": "2026-12-06", "machine": {"cpu": "x", "cores": 16}, "versions": {},
            "plan": "", "machine_name": "h100", "shapes": ["32b"], "batches": [1, 16], "tp": [1, 2],
            "eval_tokens": 2048}
    wide.save(data, [ran, gone], tmp_path / "res")
    saved = {c["name"]: c for c in json.loads((tmp_path / "res" / "results.json").read_text())["cases"]}
    assert saved["32b/gptq/eval-tp1"]["result"]["error"] == ran.result["error"]
    lines = (tmp_path / "res" / "README.md").read_text().splitlines()
    assert "| eval | rc | ppl | KLD | top-1 | error |" in lines
    assert f"| 32b/gptq/eval-tp1 | {ran.result['rc']} | - | - | - | `{ran.result['error']!r}` |" in lines
    assert f"| 32b/awq/eval-tp1 | - | - | - | - | `{gone.result['error']!r}` |" in lines


def test_a_reference_machine_with_a_figure_given_says_it_planned_for_the_figure(tmp_path: Path) -> None:
    """``--machine h200 --gpu-bytes 85e9`` planned for 85 GB while its line said only "planned for the reference
    h200": the line names each figure given over the reference machine's."""
    ref = wide.machine(wide.parse(["--machine", "h200", "--workdir", str(tmp_path)]))
    given = wide.machine(wide.parse(["--machine", "h200", "--gpu-bytes", "85e9", "--disk-bytes", "64e9",
                                     "--workdir", str(tmp_path)]))
    assert ref.said[-1].endswith("half the host memory)")
    assert given.gpu_bytes == 85e9 and given.said[-1] == ref.said[-1] + ", but for --gpu-bytes, --disk-bytes as given"
