"""Shared fixtures (the reference model, a CLI runner that starts a real ``quantkit`` process) and the test tiers.

Every test belongs to exactly one tier (docs/testing.md): ``unit`` (pure Python, no model loads), ``cli`` (real
``quantkit`` processes on fast paths), ``e2e`` (real models end to end) or ``gpu`` (needs CUDA, skipped without).
A module says its tier once, ``pytestmark = pytest.mark.<tier>`` at its top; a test marked with another tier (or
``slow``, which means e2e) takes that one instead. Collection fails when a test has no tier, so a new module cannot
slip past ``make test-fast`` or into it unnoticed.

``make test`` runs the suite on two pytest-xdist workers, a module's tests on one worker (``--dist loadfile``), so a
module fixture is built once. A session artifact that several modules read is built once for both workers
(:func:`shared_artifact`), and each worker runs torch on one thread (:func:`pytest_configure`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "quantkit-tiny"
SMOLLM2 = ROOT / "models" / "real" / "SmolLM2-135M-Instruct"
TIERS = ("unit", "cli", "e2e", "gpu")
COST_ORDER = ("e2e", "cli", "unit", "gpu")  # the tiers from the costliest per module (gpu: skipped without CUDA)


@functools.cache
def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# A test that needs CUDA is in the gpu tier, which is skipped without a GPU (pytest_runtest_setup below).
requires_gpu = pytest.mark.gpu


def _nearest_tier(item: pytest.Item) -> str | None:
    """The tier of the mark nearest the test (its own, its class's, its module's); ``slow`` alone counts as e2e.
    Two different tiers on one node are an error: the test's cost would be ambiguous."""
    for node in item.iter_parents():
        names = {m.name for m in node.own_markers}
        tiers = names.intersection(TIERS) or ({"e2e"} if "slow" in names else set())
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid}: {node.name} is marked with tiers {sorted(tiers)}; give it one")
        if tiers:
            return tiers.pop()
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each test exactly its one tier before ``-m`` selects (this hook runs first): the nearest tier mark
    replaces the module's, so ``-m "unit or cli"`` never picks up a slow test of a fast module. Refuse the run when
    a test has no tier."""
    tiers = {item: _nearest_tier(item) for item in items}
    untiered = [item.nodeid for item, tier in tiers.items() if tier is None]
    if untiered:
        shown = "\n  ".join(untiered[:20]) + (f"\n  ... and {len(untiered) - 20} more" if len(untiered) > 20 else "")
        raise pytest.UsageError(f"{len(untiered)} test(s) have no tier mark: put `pytestmark = pytest.mark.<tier>` "
                                f"at the top of the module, one of {', '.join(TIERS)} (docs/testing.md):\n  {shown}")
    for item, tier in tiers.items():
        for node in item.iter_parents():
            node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]
        item.add_marker(tier)
    items.sort(key=_costliest_first(tiers))


def _costliest_first(tiers: dict[pytest.Item, str]) -> Callable[[pytest.Item], tuple[int, int]]:
    """The order modules are handed to pytest-xdist's workers in (the Makefile's ``--no-loadscope-reorder`` keeps
    it): modules with end-to-end tests first, the more of them the earlier, then cli, unit and gpu modules, which
    are cheap and fill the workers' last minutes. xdist's own order (most tests first) put the cheap unit modules
    first and left a few slow modules of few tests running alone at the end. Stable: a module's tests keep theirs."""
    rank: dict[str, int] = {}
    heavy: dict[str, int] = {}
    for item, tier in tiers.items():
        module = item.nodeid.split("::")[0]
        rank[module] = min(rank.get(module, len(COST_ORDER)), COST_ORDER.index(tier))
        heavy[module] = heavy.get(module, 0) + (tier == COST_ORDER[0])
    return lambda item: (rank[m := item.nodeid.split("::")[0]], -heavy[m])


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker, torch and OpenMP run one thread (unless OMP_NUM_THREADS says otherwise), in the
    worker and in every ``quantkit`` process it starts: two workers of two threads each would put four busy threads
    on a 2-core machine, where one thread per process already measured faster (docs/testing.md, two workers)."""
    if hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The gpu tier skips without CUDA, asked only when such a test runs (it imports torch)."""
    if item.get_closest_marker("gpu") and not has_cuda():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch single-threaded for a module's in-process quantization: on a shared 2-core machine OpenMP threads
    spin-waiting on busy cores make llm-compressor's many small ops an order of magnitude slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny() -> Path:
    """The reference model shipped in models/quantkit-tiny."""
    return TINY


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, real pretrained weights (Apache-2.0), built by ``make real-models``
    (scripts/build_real_models.py) and linked into models/real/. It fails, never skips, when the folder is missing:
    ``make test`` builds it first, so a missing model is a broken setup, and a skip would hide every test on it."""
    if not (SMOLLM2 / "BUILD.json").is_file():
        pytest.fail(f"{SMOLLM2} is missing or unfinished: build it with `make real-models` "
                    "(scripts/build_real_models.py)", pytrace=False)
    return SMOLLM2.resolve()


def quantkit(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 900,
             check: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m quantkit ARGS`` as a real process and capture its output."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "quantkit", *map(str, args)], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"quantkit {' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


def token_gguf(path: Path, tokens: list[str], file_type: int | None = None) -> Path:
    """A GGUF file gguf-py writes with a token list, one tensor and, where given, a file type: no model llama.cpp
    could load, but what inspect, doctor and the vocabulary check read."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_token_list(tokens)
    w.add_tensor("t", np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tree_sha256(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its sha256: what a read-only shared artifact must still hold at the end."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def shared_artifact(tmp_path_factory: pytest.TempPathFactory, name: str,
                    build: Callable[[Path], object]) -> Iterator[Path]:
    """An artifact folder ``build`` makes once per run for every test that reads it, whichever pytest-xdist worker
    runs that test: the first worker to ask builds it under a lock in the folder the workers share (the parent of
    each worker's base temp), the others wait and read it. Read only: ``eval`` and ``smoke`` record their results
    in the artifact, so a test that runs them copies it first (shutil.copytree); each worker's session ends in an
    error if anything under it differs from what was built."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    out, digest = shared / name, shared / f"{name}.sha256.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not digest.is_file():
            shutil.rmtree(out, ignore_errors=True)  # what a failed build in another worker left
            build(out)
            digest.write_text(json.dumps(_tree_sha256(out)))
    built = json.loads(digest.read_text())
    yield out
    assert _tree_sha256(out) == built, f"a test wrote into the shared artifact {out}: copy it first"


@pytest.fixture(scope="session")
def tiny_rtn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``quantkit rtn`` of the reference model with the verb's defaults (W4A16 in groups of 128, compressed-tensors
    pack-quantized), made once per run for every test that reads such an artifact (:func:`shared_artifact`)."""
    yield from shared_artifact(tmp_path_factory, "tiny-rtn", lambda out: quantkit("rtn", TINY, out, "--quiet",
                                                                                  check=True))


@pytest.fixture(scope="session")
def tiny_gguf_f32_f16(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``quantkit gguf --type F32 --type F16`` of the reference model, one artifact folder, made once per run for
    every test that reads the unquantized GGUF files (llama.cpp's tools, evaluation; :func:`shared_artifact`)."""
    yield from shared_artifact(tmp_path_factory, "tiny-gguf",
                               lambda out: quantkit("gguf", TINY, out, "--type", "F32", "--type", "F16", check=True))


@pytest.fixture(scope="session")
def tiny_gguf_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``quantkit gguf --type Q4_K_M`` of the reference model (llama.cpp's mix, no matrix), made once per run for the
    tests that read it (:func:`shared_artifact`)."""
    yield from shared_artifact(tmp_path_factory, "tiny-gguf-q4_k_m",
                               lambda out: quantkit("gguf", TINY, out, "--type", "Q4_K_M", check=True))


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``quantkit gguf`` of SmolLM2 with the verb's defaults (Q4_K_M), made once per run (:func:`shared_artifact`)
    for the modules that read a real model's GGUF (tests/test_gguf_real.py, tests/test_tasks.py): converting it
    takes minutes of CPU."""
    yield from shared_artifact(tmp_path_factory, "smollm2-gguf",
                               lambda out: quantkit("gguf", smollm2, out, "--json", check=True))


@pytest.fixture(scope="session")
def smollm2_rtn(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``quantkit rtn`` of SmolLM2 with the verb's defaults (W4A16 g128), made once per run for the modules that
    evaluate a real model's compressed-tensors artifact (:func:`shared_artifact`)."""
    yield from shared_artifact(tmp_path_factory, "smollm2-rtn",
                               lambda out: quantkit("rtn", smollm2, out, "--quiet", check=True))


def live_children(pid: int) -> list[tuple[psutil.Process, list[str]]]:
    """A process's descendants with their command lines, leaving out those that exit while being read.

    A child that has just exited is a zombie until its parent reaps it, and reading its command line then raises:
    tests that poll for a server or a tool to start must not fail on that race.
    """
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            found.append((child, child.cmdline()))
        except psutil.Error:
            continue
    return found


def gone(proc: int | psutil.Process) -> bool:
    """Whether a process has exited: no longer there, or a zombie waiting for its parent to reap it. Given the
    Process object seen while it ran, a new process that reuses its pid does not count as it."""
    try:
        p = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="session")
def cli():
    """The :func:`quantkit` runner as a fixture."""
    return quantkit


def sparse_checkpoint(folder: Path, config: dict, tensors: dict[str, list[int]]) -> Path:
    """A real checkpoint (config, the reference model's tokenizer, one bf16 ``model.safetensors``) whose data is a
    sparse file: its header and size are what a model of that shape has, its bytes take no disk. For what quantkit
    decides from headers alone (memory plans and refusals) at sizes no test machine could load."""
    import json
    import math
    import shutil
    import struct

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / name, folder / name)
    (folder / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return folder


def log_probs(path: Path, windows: Any) -> Any:
    """Next-token log-probabilities from transformers in the checkpoint's dtype (compressed-tensors checkpoints
    decompress on load; FP4 into bfloat16), one window at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
    with torch.no_grad():
        logits = torch.cat([model(windows[i:i + 1]).logits.float() for i in range(len(windows))])
    assert torch.isfinite(logits).all(), f"{path} gives non-finite logits"
    return logits.log_softmax(-1)


def kld(base: Any, other: Any) -> float:
    """Mean KL(base || other) over every position, nats per token."""
    return (base.exp() * (base - other)).sum(-1).mean().item()
