"""Waiting on a child process (an engine's server starting, a worker loading a model) without waiting blind.

Every wait shows what it waits for, for how long, and the child's last log line (:meth:`Reporter.waiting`: a live
line on a terminal, a plain line every 15 s otherwise). A child that makes no progress for ``stall_timeout``
seconds is given up on with one line that names it, what was awaited, for how long, and its last log line, then
its log's tail (:class:`ProcessStalled`); the caller stops it. Progress is any of:

* its log grew (a line, or a progress bar's redraw);
* the set of processes in its tree changed;
* a compiler runs in its tree (:data:`COMPILERS`: nvcc and the programs it drives, ninja, the host compilers and
  linkers). An engine that builds kernels on first use runs one compiler process for minutes with nothing in its log:
  SGLang 0.5.17 compiles its Marlin GEMM for W4A16 (``sglang.kernels.ops.quantization.gptq_marlin`` through
  tvm-ffi's ``load_jit``, cached in ``~/.cache/tvm-ffi``) inside its first forward pass, which with CUDA graphs on is
  the capture of the largest batch. An H100 start was stopped at 180 s there, silent at "Capturing batches (bs=64
  ...) 0/12"; with this rule a later H100 start on a fresh kernel cache captured for 243 s and was healthy after
  292 s (bench/results/h100/8b/README.md). A compiler of the same user outside the tree counts too (there, not a
  build driver: :data:`BUILD_DRIVERS`): two servers starting at once build the same kernel under one file lock in
  that user's cache (tvm-ffi's ``FileLock``, polled every 0.1 s), and the one that waits for the lock runs no
  compiler of its own while the other compiles. The wait line says which (``compiling (cicc)``, or ``another
  process of this user compiling (cicc)``). The overall timeout still bounds a compiler that never ends;
* the GPU memory its processes hold changed, read from ``nvidia-smi --query-compute-apps`` where it exists (a large
  model's weights load silently into GPU memory). Where none of the listed processes is the child's (a container's
  own process ids), the memory of every listed process is watched instead.

An H200 SGLang server started beside another one hung at launch with nothing on the GPU for more than 5 minutes,
while the overall timeout (600 s for smoke, 900 s for SGLang's evaluation) was still running. The default of
180 s is generous against the longest silence seen in a healthy start: vLLM 0.26.0 stays silent 28 s twice while
starting the 135M model (bench/results/h200/modelopt_fp8_vllm_serve.log), and a long weight load shows as GPU
memory taken; it is the recipe's ``smoke.stall_timeout`` and ``--stall-timeout`` on ``smoke``, 0 turns it off.

The line that stops a child also says how many CPU-seconds its processes used since their last progress: not a sign
of progress (a hung server may spin as well as sleep), but what tells a silent server busy in its own process
(compiling in-process, or looping) from one waiting on something.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import BackendError, exit_text
from quantkit.progress import Reporter
from quantkit.recipe import DEFAULT_STALL_TIMEOUT, NO_PROGRESS
TAIL_LINES = 30
HEADER = "# quantkit"  # the line quantkit writes first into a child's log (its command): not the child's own word
POLL_S = 0.5
PROBE_S = 5.0  # how often the process tree and GPU memory are read (each read scans /proc or runs nvidia-smi)
NVIDIA_SMI_TIMEOUT_S = 10.0
# Programs whose running counts as progress, by the name /proc gives a process (its first 15 characters): CUDA's
# compiler driver and the stages it runs, the build tools engines' JIT loaders call, host compilers and linkers.
COMPILERS = frozenset({
    "nvcc", "cicc", "ptxas", "cudafe++", "fatbinary", "nvlink", "ninja", "make", "cmake",
    "cc", "c++", "gcc", "g++", "cc1", "cc1plus", "clang", "clang++", "as", "ld", "ld.bfd", "ld.gold", "ld.lld",
    "collect2", "hipcc", "amdclang++",
})
# Build drivers: in a server's tree they are its build, but beside it they say nothing of one (``make test`` runs
# for as long as the tests it started), so outside the tree only the compilers they drive count.
BUILD_DRIVERS = frozenset({"ninja", "make", "cmake"})


class ProcessDied(BackendError):
    """The child exited on its own before it was ready (or while answering: a native crash)."""


class WaitTimedOut(BackendError):
    """The child was not ready within the overall timeout."""


class ProcessStalled(WaitTimedOut):
    """The child made no progress (no log output, no new process, no compiler running, no change of GPU memory) for
    ``stall_timeout``."""


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log (reading only its end, logs of big models get long); a progress bar's
    carriage returns count as line ends."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    text = text.replace("\r", "\n")
    tail = [ln for ln in text.splitlines() if ln.strip()][-lines:]
    return "\n".join(ln if len(ln) <= 400 else ln[:400] + " …" for ln in tail)


def last_line(path: Path, width: int = 160) -> str:
    """The child's last non-empty log line, cut to ``width`` characters (a status line's worth); empty while it
    has said nothing (quantkit's own first line does not count)."""
    line = log_tail(path, 1)
    if line.startswith(HEADER):
        return ""
    return line if len(line) <= width else line[:width] + " …"


def failure(what: str, log_path: Path) -> str:
    """An error message: ``what`` happened, then the log's last lines (or that the log is empty)."""
    tail = log_tail(log_path)
    if not tail:
        return f"{what} (its log {log_path} is empty)"
    return f"{what}. Last lines of {log_path}:\n{tail}"


@dataclass(frozen=True)
class Proc:
    """One live process as its /proc/PID/stat gives it."""

    ppid: int
    pgid: int
    name: str  # the program's name (its first 15 characters)
    ticks: int  # CPU time used: user + system, with that of its exited and reaped children
    uid: int  # its owner (the /proc entry's): whose caches and locks it can share


def live_processes() -> dict[int, Proc] | None:
    """Every process /proc lists that is not a zombie, by pid, read in one pass (each file once); None without
    /proc. The tree, its compilers and its CPU time are all read from one such pass."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    out: dict[int, Proc] = {}
    for p in proc.iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat, uid = p.joinpath("stat").read_text(), p.stat().st_uid
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 15 and fields[0] != "Z":  # utime, stime, cutime, cstime: stat's fields 14-17
            out[int(p.name)] = Proc(int(fields[1]), int(fields[2]), stat[stat.find("(") + 1:stat.rfind(")")],
                                    sum(int(f) for f in fields[11:15]), uid)
    return out


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a child's process group (its own session): the engine's workers and compilers with it. A
    group already gone, or not ours to signal, is not an error: what is wanted is that it is not running."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def process_tree(root: int, procs: dict[int, Proc] | None) -> frozenset[int]:
    """The processes of ``root``'s tree in ``procs`` (:func:`live_processes`): its process group (a server's own
    session) and every descendant of ``root`` (one that started a session of its own included); ``{root}`` without
    /proc."""
    if procs is None:
        return frozenset({root})
    members = {root} | {pid for pid, p in procs.items() if p.pgid == root}
    for pid in procs:
        chain, seen = pid, 0
        while chain > 1 and seen < 64:  # walk up to the root (or init); 64 levels bound a /proc read mid-fork
            if chain == root:
                members.add(pid)
                break
            chain, seen = (procs[chain].ppid if chain in procs else 0), seen + 1
    return frozenset(members)


def cpu_seconds(pids: frozenset[int], procs: dict[int, Proc] | None) -> float | None:
    """The CPU time (user + system, with that of their exited and reaped children) the processes have used, from
    ``procs``; None without /proc. Not a sign of progress (a hung server may spin as well as sleep), but said when one
    is stopped: a silent server busy on the CPU is compiling or looping, an idle one is waiting on something. A
    process gone since is not counted: its time is in its parent's once reaped."""
    if procs is None:
        return None
    return sum(procs[pid].ticks for pid in pids if pid in procs) / os.sysconf("SC_CLK_TCK")


def compilers(pids: frozenset[int], procs: dict[int, Proc] | None) -> list[str]:
    """The names of the :data:`COMPILERS` running among ``pids`` (sorted, each once; empty without /proc): an
    engine building kernels, which is progress however long one compiler runs without a word."""
    return sorted({procs[pid].name for pid in pids if pid in procs and procs[pid].name in COMPILERS}) if procs else []


def compilers_beside(tree: frozenset[int], uid: int, procs: dict[int, Proc] | None) -> list[str]:
    """The :data:`COMPILERS` that ``uid``'s processes outside ``tree`` run: a build the tree may be waiting on
    through a lock in that user's kernel cache (another server's, started at the same time)."""
    if not procs:
        return []
    mine = frozenset(pid for pid, p in procs.items() if p.uid == uid and p.name not in BUILD_DRIVERS)
    return compilers(mine - tree, procs)


class GpuMemory:
    """The GPU memory (MiB) a set of processes holds, from ``nvidia-smi``; None where there is no NVIDIA driver
    or it does not answer (then it is not asked again: a hung driver must not slow every poll)."""

    def __init__(self) -> None:
        self.tool = shutil.which("nvidia-smi")

    def of(self, pids: frozenset[int]) -> int | None:
        if self.tool is None:
            return None
        try:
            out = subprocess.run([self.tool, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            self.tool = None
            return None
        rows: list[tuple[int, int]] = []
        for line in out.splitlines():
            pid, _, mib = line.partition(",")
            try:
                rows.append((int(pid), int(mib)))
            except ValueError:  # "[N/A]" on some drivers
                continue
        mine = [mib for pid, mib in rows if pid in pids]
        return sum(mine) if mine else sum(mib for _, mib in rows)


class Activity:
    """Whether a child still makes progress: when it last did, and which signals are watched."""

    def __init__(self, pid: int, log_path: Path, gpu: GpuMemory | None = None) -> None:
        self.pid = pid
        self.log_path = log_path
        self.gpu = gpu or GpuMemory()
        now = time.monotonic()
        self.last = now
        self._probed = now - PROBE_S
        self._size = self._log_size()
        self._tree: frozenset[int] = frozenset()
        self._memory: int | None = None
        self.compiling: list[str] = []  # the compilers running in its tree at the last probe (said in the wait line)
        self.compiling_beside: list[str] = []  # else those of the same user's other processes
        self._cpu_at_progress: float | None = None  # the tree's CPU-seconds at the first probe after progress
        self._cpu_since = now  # when that was

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def poll(self) -> float:
        """Look at the signals; the seconds since the last progress."""
        now = time.monotonic()
        size = self._log_size()
        moved = size != self._size
        self._size = size
        if now - self._probed >= PROBE_S:
            self._probed = now
            procs = live_processes()  # one pass over /proc for the tree, its compilers and its CPU time
            tree = process_tree(self.pid, procs)
            memory = self.gpu.of(tree)
            self.compiling = compilers(tree, procs)
            self.compiling_beside = [] if self.compiling else compilers_beside(tree, os.getuid(), procs)
            moved = (moved or tree != self._tree or memory != self._memory or bool(self.compiling)
                     or bool(self.compiling_beside))
            self._tree, self._memory = tree, memory
            if moved or self.last > self._cpu_since or self._cpu_at_progress is None:
                self._cpu_at_progress, self._cpu_since = cpu_seconds(tree, procs), now  # the count restarts here
        if moved:
            self.last = now
        return now - self.last

    def signals(self) -> str:
        """What "no progress" meant here, and how busy the processes were meanwhile, for the error."""
        said = (NO_PROGRESS if self.gpu.tool else
                NO_PROGRESS.replace(", no change of its GPU memory", "; GPU memory not watched: no nvidia-smi"))
        procs = live_processes()
        now = cpu_seconds(process_tree(self.pid, procs), procs)
        if now is None or self._cpu_at_progress is None:
            return said
        return f"{said}; its processes used {max(0.0, now - self._cpu_at_progress):.1f} CPU-seconds meanwhile"


def wait_until(ready: Callable[[], bool], *, who: str, waits_for: str, proc: subprocess.Popen[Any],
               log_path: Path, timeout: float, stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
               reporter: Reporter | None = None, poll_s: float = POLL_S) -> float:
    """Poll ``ready()`` until it is true, showing the wait; the seconds waited.

    ``who`` names the child ("the sglang server on :30001"), ``waits_for`` what it should do ("answer
    /health"). Raises :class:`ProcessDied` when ``proc`` exits first, :class:`WaitTimedOut` past ``timeout``, and
    :class:`ProcessStalled` after ``stall_timeout`` seconds without progress (None or 0: never); each names the
    child and carries its log's tail. The caller stops the child (its ``with`` block or ``finally``). A child
    that speaks a pipe protocol can be waited on with ``ready`` reading ``select.select([pipe], [], [], 0)``.
    """
    rep = reporter or Reporter(quiet=True)
    start = time.monotonic()
    activity = Activity(proc.pid, log_path)
    with rep.waiting(f"waiting for {who} to {waits_for}") as say:
        while True:
            if ready():
                return time.monotonic() - start
            elapsed = time.monotonic() - start
            rc = proc.poll()
            if rc is not None:
                raise ProcessDied(failure(f"{who} {exit_text(rc)} {elapsed:.0f} s after it started, before it was "
                                          "ready", log_path), hint=f"the whole log is {log_path}")
            if elapsed > timeout:
                raise WaitTimedOut(failure(f"{who} did not {waits_for} within {timeout:.0f}s", log_path),
                                   hint=f"raise --timeout, or read the whole log: {log_path}")
            still = activity.poll()
            if stall_timeout and still > stall_timeout:
                line = last_line(log_path) or "(its log is empty)"
                raise ProcessStalled(
                    failure(f"{who} made no progress for {still:.0f} s ({activity.signals()}) while quantkit "
                            f"waited {elapsed:.0f} s for it to {waits_for}, and is stopped; its last log line: "
                            f"{line}", log_path),
                    hint=f"a slower start that is still healthy needs a longer --stall-timeout (recipe: "
                         f"smoke.stall_timeout); the whole log is {log_path}")
            building = (f"compiling ({', '.join(activity.compiling)}), " if activity.compiling else
                        f"another process of this user compiling ({', '.join(activity.compiling_beside)}), "
                        if activity.compiling_beside else "")
            say(f"waiting for {who} to {waits_for}: {elapsed:.0f} s, {building}"
                f"last log: {last_line(log_path) or '(none yet)'}")
            time.sleep(poll_s)
