"""No silent waits: a server quantkit waits on shows what it waits for, and one that stops making progress is
stopped and named in one line (quantkit.engines.watch, through quantkit.engines.serving).

The servers are real processes (small Python scripts given as the server command), waited on by the real serving
code: one that prints and then goes silent, one that is slow but keeps printing until it answers /health."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from conftest import TINY, gone, quantkit
from quantkit import progress
from quantkit.engines import watch
from quantkit.engines.serving import ServerProcess
from quantkit.engines.vllm import kernel_sweep
from quantkit.errors import EXIT_FAILURE, UsageError
from quantkit.progress import Reporter

pytestmark = pytest.mark.cli

# Prints a line, then hangs without a word: what an SGLang server beside another one did on the H200.
SILENT = textwrap.dedent("""\
    import sys, time
    print("Load weight begin. avail mem=79.1 GB", flush=True)
    time.sleep(600)
    """)

# Prints a line, then works the CPU without a word: a server compiling in its own process, or spinning.
BUSY = textwrap.dedent("""\
    print("Capturing batches (bs=64 avail_mem=11.57 GB):   0%|", flush=True)
    while True:
        pass
    """)

# Prints a line a second and answers /health (200) only after READY_S seconds: slow, never stalled.
SLOW = textwrap.dedent("""\
    import http.server, sys, threading, time
    port, ready_s = int(sys.argv[1]), float(sys.argv[2])
    start = time.monotonic()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if time.monotonic() - start > ready_s else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for i in range(600):
        print(f"compiling kernel {i}", flush=True)
        time.sleep(1.0)
    """)

# The start of BUILDS and LOCKED: /health answers 503 until ``done`` is set, then 200; the log says the one line
# SGLang's W4A16 start went silent after. argv[1] is the port, argv[2] what the script is given.
SILENT_UNTIL_DONE = textwrap.dedent("""\
    import fcntl, http.server, os, subprocess, sys, threading, time
    port, given = int(sys.argv[1]), sys.argv[2]
    done = threading.Event()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if done.is_set() else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("Capturing batches (bs=64 avail_mem=11.57 GB):   0%|", flush=True)
    """)

# Says one line, then runs the program argv[2] (a kernel compiler, or not) without a word and answers /health (200)
# once it has ended: an SGLang W4A16 server compiling its Marlin GEMM inside its first forward pass.
BUILDS = SILENT_UNTIL_DONE + textwrap.dedent("""\
    subprocess.run([given], check=True)
    done.set()
    time.sleep(600)
    """)


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_silent_server_is_stopped_and_named_in_one_line(tmp_path: Path) -> None:
    """The CLI: ``smoke --stall-timeout 2`` on a server that goes silent ends in 1 (not the 600 s timeout) with one
    line naming the engine, what it waited for, how long, and the server's last log line; the wait was shown."""
    gguf = tmp_path / "art"
    gguf.mkdir()
    (gguf / "m.gguf").write_bytes(b"")
    script = _script(tmp_path, "silent.py", SILENT)
    started = time.monotonic()
    proc = quantkit("smoke", gguf, "--engine", "llama.cpp", "--skip-doctor", "--server-cmd",
                    f"{sys.executable} {script} {{port}}", "--stall-timeout", "2", "--log-dir", tmp_path, "--json",
                    timeout=120)
    assert proc.returncode == EXIT_FAILURE, proc.stderr[-2000:]
    assert time.monotonic() - started < 60
    run = json.loads(proc.stdout)["runs"][0]
    first = run["error"].splitlines()[0]
    assert first.startswith("the llama.cpp server on :") and "made no progress for" in first
    assert "to answer /health" in first and "its last log line: Load weight begin. avail mem=79.1 GB" in first
    assert run["stopped"] and gone(run["pid"])
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "made no progress" in error[0] and "Load weight begin" in error[0]
    assert "Traceback" not in proc.stderr
    # not a terminal: the wait is said in plain lines on stderr
    assert "waiting for the llama.cpp server on :" in proc.stderr and "to answer /health: " in proc.stderr


def test_a_slow_server_that_keeps_talking_is_waited_for(tmp_path: Path) -> None:
    """A server healthy after 4 s, printing every second, is not stopped by a 2 s stall timeout; the wait is said
    with the server's last log line."""
    script = _script(tmp_path, "slow.py", SLOW)
    out = io.StringIO()
    rep = Reporter(Console(file=out, stderr=True, width=300))
    srv = ServerProcess("slowpoke", lambda port: [sys.executable, str(script), str(port), "4"],
                        log_path=tmp_path / "slow.log", timeout=60, stall_timeout=2.0, reporter=rep)
    with srv:
        assert srv.healthy_after is not None and srv.healthy_after >= 4
        pid = srv.proc.pid if srv.proc else 0
    assert gone(pid)
    said = out.getvalue()
    assert f"waiting for the slowpoke server on :{srv.port} to answer /health: 0 s, last log: " in said
    assert "slowpoke server ready" in said


def _port_in_time_wait() -> int:
    """A loopback port whose listener is gone and whose last connection waits in TIME_WAIT: what a fixed --port is
    when smoke starts the next .gguf file's server. The listener sets SO_REUSEADDR as the servers do (a TIME_WAIT
    socket lets a new one bind only when both set it); the server's side closes first, so the wait is on its port."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = int(listener.getsockname()[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()
            assert client.recv(1) == b""  # the server's FIN has arrived: its side is past FIN_WAIT_1
    return port


def test_a_fixed_port_in_time_wait_is_free_and_one_with_a_listener_is_not(tmp_path: Path) -> None:
    """``smoke --port P`` on a GGUF artifact of several files refused the second with "port P is already in use":
    the check bound without SO_REUSEADDR, which a port in TIME_WAIT refuses while the servers, which set it, bind
    it. The check now answers what the server meets: a server starts there; a port with a listener stays in use."""
    port = _port_in_time_wait()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # the state the old check called "in use"
    script = _script(tmp_path, "slow.py", SLOW)
    srv = ServerProcess("slowpoke", lambda p: [sys.executable, str(script), str(p), "0"],
                        log_path=tmp_path / "slow.log", port=port, timeout=60)
    with srv:
        assert srv.port == port and srv.healthy_after is not None
        pid = srv.proc.pid if srv.proc else 0
        busy = ServerProcess("second", lambda p: [sys.executable, str(script), str(p), "0"],
                             log_path=tmp_path / "second.log", port=port, timeout=60)
        with pytest.raises(UsageError, match=f"port {port} on 127.0.0.1 is already in use"):
            busy.__enter__()
        assert busy.proc is None  # refused before anything started
    assert gone(pid)


def test_an_overall_timeout_still_bounds_a_talking_server(tmp_path: Path) -> None:
    """Progress is no licence to wait forever: the overall timeout stops a server that talks but never answers."""
    script = _script(tmp_path, "slow.py", SLOW)
    srv = ServerProcess("slowpoke", lambda port: [sys.executable, str(script), str(port), "600"],
                        log_path=tmp_path / "slow.log", timeout=3, stall_timeout=2.0)
    with pytest.raises(watch.WaitTimedOut) as caught:
        srv.__enter__()
    assert not isinstance(caught.value, watch.ProcessStalled)
    assert "did not answer /health within 3s" in caught.value.message and "compiling kernel" in caught.value.message
    assert not srv.running()


def test_a_sweep_load_that_goes_silent_is_stopped_and_says_why(tmp_path: Path) -> None:
    """tune's kernel sweep waits on each vLLM load through the same watch: a load that stops speaking is stopped
    after the stall timeout, its log ending with the reason the measurement reports; one that finishes is not."""
    log = tmp_path / "load.log"
    silent = [sys.executable, "-c", "print('loading', flush=True); import time; time.sleep(60)"]
    rc, seconds = kernel_sweep.run_logged(silent, dict(os.environ), log, 50, who="a vLLM load", stall_timeout=2)
    assert rc is None and seconds < 40
    stopped = log.read_text().splitlines()[-1]
    assert stopped.startswith(kernel_sweep.STOPPED) and "a vLLM load made no progress" in stopped
    assert "last log line: loading" in stopped
    assert kernel_sweep.run_logged([sys.executable, "-c", "print('ok')"], dict(os.environ), log, 50)[0] == 0


# Stands in for vLLM's Python under `eval --engine vllm` (run as `PY WORKER REQUEST`, it ignores both): says what a
# load says, starts a child as vLLM's engine core does, then neither answers READY nor says another word.
HUNG_LOAD = textwrap.dedent("""\
    import subprocess, sys, time
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"INFO Starting to load model, engine core {core.pid}", file=sys.stderr, flush=True)
    time.sleep(600)
    """)


def test_an_eval_worker_whose_load_stalls_is_stopped_and_named(tmp_path: Path) -> None:
    """``eval --engine vllm``'s worker is waited on as a server is: a load that goes silent is stopped after
    ``--stall-timeout`` (not left to hang the release), named in one line with its last log line, exit 1, and its
    whole process group (the engine core too) is gone."""
    python = _script(tmp_path, "vllm-python", f"#!{sys.executable}\n" + HUNG_LOAD)
    python.chmod(0o755)
    started = time.monotonic()
    proc = quantkit("eval", TINY, "--baseline", TINY, "--engine", "vllm", "--python", python, "--stall-timeout", "2",
                    "--dataset", "heldout", "--max-tokens", "64", "--report-dir", tmp_path / "report", timeout=120)
    assert proc.returncode == EXIT_FAILURE, proc.stderr[-2000:]
    assert time.monotonic() - started < 60
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, proc.stderr[-2000:]
    assert "vLLM's worker for quantkit-tiny made no progress for" in error[0] and "to load the model" in error[0]
    assert "its last log line: INFO Starting to load model, engine core" in error[0]
    assert "waiting for vLLM's worker for quantkit-tiny to load the model: " in proc.stderr
    assert "Traceback" not in proc.stderr
    core = int(error[0].split("engine core ")[1].split()[0].rstrip(".,;"))
    assert gone(core)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_a_stopped_server_is_said_busy_or_idle_on_the_cpu(tmp_path: Path, busy: bool) -> None:
    """The stall line says how many CPU-seconds the server's processes used since their last progress: a server
    silent on the CPU's work (compiling, spinning) is told from one asleep on something, which the H100's stopped
    SGLang W4A16 start could not be."""
    script = _script(tmp_path, "stuck.py", BUSY if busy else SILENT)
    srv = ServerProcess("stuck", lambda port: [sys.executable, str(script)], log_path=tmp_path / "stuck.log",
                        timeout=120, stall_timeout=3.0)
    with pytest.raises(watch.ProcessStalled) as stalled:
        with srv:
            pass
    first = str(stalled.value).splitlines()[0]
    used = float(first.split("its processes used ", 1)[1].split(" CPU-seconds meanwhile", 1)[0])
    assert (used > 0.8) if busy else (used < 0.4), first
    assert gone(srv.proc.pid if srv.proc else 0)


@pytest.fixture
def quick_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process tree read every 0.5 s, not every 5 s, so that a 2 s stall timeout sees it, and the plain wait line
    said every second, not every 15."""
    monkeypatch.setattr(watch, "PROBE_S", 0.5)
    monkeypatch.setattr(progress, "SAY_EVERY_S", 1.0)


def _silent_start(tmp_path: Path, text: str, given: Path, *, waited: bool, healthy_after: float) -> str:
    """Start the script ``text`` (SILENT_UNTIL_DONE's kind) given ``given`` under a 2 s stall timeout. ``waited``:
    it must be waited for until healthy (at least ``healthy_after`` s), its wait's lines returned; else it must be
    stopped as making no progress, with no compiler running."""
    script = _script(tmp_path, "server.py", text)
    out = io.StringIO()
    srv = ServerProcess("silent", lambda port: [sys.executable, str(script), str(port), str(given)],
                        log_path=tmp_path / "server.log", timeout=60, stall_timeout=2.0,
                        reporter=Reporter(Console(file=out, stderr=True, width=300)))
    if not waited:
        with pytest.raises(watch.ProcessStalled) as stalled:
            srv.__enter__()
        assert "no compiler running" in str(stalled.value).splitlines()[0]
        assert not srv.running()
        return out.getvalue()
    with srv:
        assert srv.healthy_after is not None and srv.healthy_after >= healthy_after
        pid = srv.proc.pid if srv.proc else 0
    assert gone(pid)
    assert f"waiting for the silent server on :{srv.port} to answer /health: " in out.getvalue()
    return out.getvalue()


@pytest.mark.parametrize("program", ["cicc", "uploader"])
def test_a_silent_server_running_a_compiler_is_waited_for(tmp_path: Path, program: str, quick_probes: None) -> None:
    """A server that runs a kernel compiler for 8 s without a word (one process, no log line, no GPU memory) is making
    progress: a 2 s stall timeout does not stop it, and the wait says what runs. The same silence with any other
    program is stopped, as before."""
    child = tmp_path / program  # /proc names a script's process after the file
    child.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(8)\n")
    child.chmod(0o755)
    said = _silent_start(tmp_path, BUILDS, child, waited=program == "cicc", healthy_after=8)
    if program == "cicc":
        assert "s, compiling (cicc), last log: Capturing batches (bs=64" in said


# Takes the lock file argv[2] as tvm-ffi's FileLock does (a non-blocking flock tried every 0.1 s), says nothing while
# it waits, and answers /health once it has it: the second of two SGLang servers started at once, waiting while the
# first builds the kernel they share.
LOCKED = SILENT_UNTIL_DONE + textwrap.dedent("""\
    while True:
        fd = os.open(given, os.O_WRONLY | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            os.close(fd)
            time.sleep(0.1)
    done.set()
    time.sleep(600)
    """)


@pytest.mark.parametrize("program", ["cicc", "uploader"])
def test_a_server_waiting_on_another_process_build_is_waited_for(tmp_path: Path, program: str,
                                                                 quick_probes: None) -> None:
    """A server that waits silently for a lock another process of the same user holds while it runs a kernel compiler
    (8 s) is making progress: a 2 s stall timeout does not stop it, and the wait says another process compiles. The
    same lock held by a program that is no compiler is a server waiting on something else: stopped, as before."""
    lock = tmp_path / "lock"
    holder_script = tmp_path / program
    holder_script.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
        import fcntl, os, sys, time
        fcntl.flock(os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT), fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(8)
        """))
    holder_script.chmod(0o755)
    holder = subprocess.Popen([str(holder_script), str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        said = _silent_start(tmp_path, LOCKED, lock, waited=program == "cicc", healthy_after=7)
        if program == "cicc":
            assert "s, another process of this user compiling (cicc), last log: Capturing batches" in said
    finally:
        holder.kill()
        holder.wait()


def test_a_build_driver_beside_a_server_is_no_build_of_its_own() -> None:
    """Outside the server's tree only the same user's compilers count: not a build driver (``make test`` runs as long
    as the tests it started, this suite's own waits among them), nor another user's compiler."""
    procs = {1: watch.Proc(0, 1, "systemd", 0, 0), 10: watch.Proc(1, 10, "server", 0, 1000),
             20: watch.Proc(1, 20, "make", 0, 1000), 21: watch.Proc(20, 20, "python3", 0, 1000),
             30: watch.Proc(1, 30, "cicc", 0, 1001)}
    tree = watch.process_tree(10, procs)
    assert watch.compilers_beside(tree, 1000, procs) == []
    assert watch.compilers_beside(tree, 1001, procs) == ["cicc"]
    procs[31] = watch.Proc(20, 20, "cc1plus", 0, 1000)
    assert watch.compilers_beside(tree, 1000, procs) == ["cc1plus"]
