"""What every engine's server shares: the :class:`Server` each engine fills in, and :class:`ServerProcess`, which
runs its OpenAI-compatible server as a child process that can never outlive quantkit.

The server starts in its own process group (its own session) on a free loopback port, so a terminal Ctrl-C
reaches quantkit only, and quantkit stops the whole group in order: SIGTERM, then SIGKILL after a grace period,
then any stragglers the engine forked (vLLM's engine-core and workers). On Linux the child also asks the kernel
for SIGTERM if quantkit itself dies without unwinding (SIGKILL, OOM), so even that does not leave a server behind.

Its stdout and stderr go to a log file. The wait for health is never silent and never blind
(:func:`quantkit.engines.watch.wait_until`): it shows what it waits for, for how long, and the log's last line, and
a server that makes no progress (:data:`quantkit.recipe.NO_PROGRESS`) for ``stall_timeout`` seconds is stopped and
named in one line. When it dies before it is healthy, stalls, or never becomes healthy, the error shows the log's
last lines and the log stays where it was written.

Tested with llama-cpp-python 0.3.36 (``llama_cpp.server``) on CPU and written for vLLM 0.26.0 (``vllm serve``).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.checkpoint import read_config
from quantkit.engines import client, registry, watch
from quantkit.engines.watch import DEFAULT_STALL_TIMEOUT, ProcessDied, log_tail
from quantkit.errors import BackendError, QuantkitError, UsageError, exit_text
from quantkit.formats.names import SERVING
from quantkit.progress import Reporter, command_reporter

HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


@dataclass
class ServeOptions:
    """What a user can say about how an engine is started (flags of ``quantkit smoke``)."""

    python: str | None = None  # the engine's own Python; None: the engine's default (see each module)
    server_cmd: str | None = None  # replaces the engine's command; {model} {host} {port} are filled in
    env: dict[str, str] = field(default_factory=dict)  # set for the server (and doctor's probe) only
    extra_args: list[str] = field(default_factory=list)  # appended to the engine's command
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    tp: int = 1  # tensor-parallel size (GPUs one server spans); checked by quantkit.engines.parallel


class Server:
    """One engine's server: how to find its Python, build its command line, and read its log.

    Subclasses (one ``server.py`` per engine folder, named by its registry row) fill in the class attributes and
    :meth:`command`; what doctor asks of the engine (``dist``, ``module``) and where its Python is come from the row.
    """

    name: str = ""
    health_path: str = "/health"
    reads_compressed_tensors: bool = False
    no_tensor_parallel: str | None = None  # set when the server cannot take --tp: what to do instead

    @property
    def row(self) -> registry.Engine:
        """The engine's row in :mod:`quantkit.engines.registry`."""
        return registry.get(self.name)

    @property
    def dist(self) -> str:
        """The distribution whose version doctor reports as the engine's."""
        return self.row.dist

    @property
    def module(self) -> str:
        """The import name that says the engine is installed in its Python."""
        return self.row.module

    def python(self, explicit: str | None) -> str:
        """The engine's Python (:func:`quantkit.envs.find`)."""
        return self.row.find_python(explicit).python

    @property
    def python_env_var(self) -> str:
        """The variable that names the engine's Python (``QUANTKIT_VLLM_PYTHON``...)."""
        return self.row.env_var

    def targets(self, artifact: Path, file: str | None) -> list[Path]:
        """What to serve, one server each: the artifact folder (GGUF overrides this: one per file)."""
        return [artifact]

    def command(self, target: Path, python: str, host: str, port: int, opts: ServeOptions) -> list[str]:
        raise NotImplementedError

    def has_chat_template(self, target: Path) -> bool:
        """Whether the server can answer chat requests for ``target``: a Hugging Face folder needs a chat
        template (engines refuse to invent one), so a base model without one skips the chat question."""
        if (target / "chat_template.jinja").exists() or (target / "chat_template.json").exists():
            return True
        try:
            return bool(json.loads((target / "tokenizer_config.json").read_text()).get("chat_template"))
        except (OSError, json.JSONDecodeError):
            return False

    def health_path_for(self, argv: list[str]) -> str:
        """The health endpoint of the server ``argv`` starts (an engine with two servers answers per server)."""
        return self.health_path

    def takes_images(self, target: Path) -> bool:
        """Whether the server answers image prompts for ``target``: a vision-language checkpoint (``config.json``
        with a ``vision_config``), which the smoke test then asks about an image."""
        return target.is_dir() and bool(read_config(target).get("vision_config"))

    def speed_extra(self, max_tokens: int) -> dict[str, Any]:
        """Request fields that keep the throughput request decoding to ``max_tokens`` (past an early EOS)."""
        return {"min_tokens": max_tokens}

    def own_decode_rate(self, event: dict[str, Any]) -> float | None:
        """The decode tokens/s the server itself reports in a streamed completion's event, if it reports one.
        Measured in the client, a fast server's events can pile up in the socket's buffer and be read in one go
        (a 10M model in llama.cpp on a busy CPU read as 111,945 tok/s); the server's own clock has no such error."""
        return None

    def log_facts(self, log_text: str) -> dict[str, Any]:
        """What the server's log says about how it runs the artifact (kernels chosen...)."""
        return {}

    def argv(self, target: Path, python: str, host: str, port: int, opts: ServeOptions) -> list[str]:
        """The command line: ``--server-cmd`` (with placeholders filled) or the engine's own, plus extra args."""
        if opts.server_cmd:
            fill = {"model": str(target), "host": host, "port": str(port), "python": python}
            try:
                base = [part.format(**fill) for part in shlex.split(opts.server_cmd)]
            except (KeyError, IndexError, ValueError) as e:
                raise UsageError(f"--server-cmd {opts.server_cmd!r}: {e}",
                                 hint="use the placeholders {model}, {host}, {port} and {python} only") from None
            if "{port}" not in opts.server_cmd:
                base += ["--host", host, "--port", str(port)]
            return base + list(opts.extra_args)
        return self.command(target, python, host, port, opts) + list(opts.extra_args)


def get(name: str) -> Server:
    """The server of the engine called ``name`` (llama.cpp, vllm, trtllm; the engine's module is imported now)."""
    if name not in SERVING:
        raise UsageError(f"unknown engine {name!r}", hint=f"choose one of: auto, {', '.join(SERVING)}")
    return importlib.import_module(registry.get(name).server or "").SERVER


def _engine_environ() -> dict[str, str]:
    """quantkit's environment for a server, less ``TQDM_DISABLE`` (which the CLI sets for its own libraries): the
    engine's progress bars (weight shards, CUDA graphs) are what tell a slow start from a hung one in its log.
    ``--env TQDM_DISABLE=1`` still turns them off."""
    return {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}


def _port_free(host: str, port: int) -> bool:
    """Whether a server could bind ``port`` on ``host`` now, binding as the servers do: with SO_REUSEADDR (set by
    llama-server b11312's cpp-httplib, seen with strace; by vLLM's own listening socket; by uvicorn's asyncio or
    uvloop listener, which SGLang and llama_cpp.server serve with). A port whose last connections wait in
    TIME_WAIT, as a fixed --port's does when the next .gguf file's server starts just after the previous one
    stopped, is free to them; one with a listener is not. Bound without it, the check refused the second file."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = HOST) -> int:
    """A port the kernel says is free on ``host`` right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when quantkit dies, even by SIGKILL (Linux only)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass


class ServerProcess:
    """A server subprocess that is healthy inside the ``with`` block and gone after it, whatever happens.

    ``with ServerProcess(...) as srv: client.get_json(srv.url + "/v1/models")``. Entering starts the server and
    waits for ``health_path`` to answer 200 (a status line shows the log's last line; ``stall_timeout`` seconds
    without progress stop it); leaving stops the process group. Without a ``reporter`` the wait reports through the
    running command's (:func:`quantkit.progress.command_reporter`). A port given as 0 is picked free on 127.0.0.1
    (and picked again once if another process took it between the pick and the server's bind).
    """

    def __init__(self, engine: str, argv_for_port: Callable[[int], list[str]], *, log_path: Path,
                 env: dict[str, str] | None = None, health_path: str = "/health", host: str = HOST, port: int = 0,
                 timeout: float = 600.0, grace: float = 15.0, reporter: Reporter | None = None,
                 stall_timeout: float | None = DEFAULT_STALL_TIMEOUT) -> None:
        self.engine = engine
        self.argv_for_port = argv_for_port
        self.log_path = Path(log_path)
        self.env = {**_engine_environ(), **(env or {})}
        self.env_overrides = dict(env or {})
        self.health_path = health_path
        self.host = host
        self.requested_port = port
        self.port = port
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self.grace = grace
        self.reporter = reporter or command_reporter()
        self.proc: subprocess.Popen[bytes] | None = None
        self.argv: list[str] = []
        self.started_at = 0.0
        self.healthy_after: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerProcess":
        if self.requested_port and not _port_free(self.host, self.requested_port):
            raise UsageError(f"port {self.requested_port} on {self.host} is already in use",
                             hint="pass --port 0 to pick a free one")
        attempts = 2 if self.requested_port == 0 else 1
        for attempt in range(attempts):
            self.port = self.requested_port or free_port(self.host)
            try:
                self._start(append=attempt > 0)
                self._wait_healthy()
                return self
            except ProcessDied as e:
                self.stop()
                if attempt + 1 < attempts and _port_taken(self.log_path):
                    continue
                raise e
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _start(self, append: bool) -> None:
        self.argv = self.argv_for_port(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab" if append else "wb") as log:
            env_note = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env_overrides.items())
            log.write(f"{watch.HEADER} smoke: {env_note + ' ' if env_note else ''}{shlex.join(self.argv)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.env, start_new_session=True,
                                             preexec_fn=_die_with_parent)
            except OSError as e:
                raise BackendError(f"could not start the {self.engine} server ({shlex.join(self.argv)}): {e}",
                                   hint="check --python / --server-cmd, or that the engine is installed") from None
        self.started_at = time.monotonic()

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        proc = self.proc

        def healthy() -> bool:
            return client.status(self.url + self.health_path, timeout=2.0) == 200 and proc.poll() is None

        self.healthy_after = round(watch.wait_until(
            healthy, who=f"the {self.engine} server on :{self.port}", waits_for=f"answer {self.health_path}",
            proc=proc, log_path=self.log_path, timeout=self.timeout, stall_timeout=self.stall_timeout,
            reporter=self.reporter), 2)
        self.reporter.log(f"[green]✓[/] {self.engine} server ready on {self.url} [dim]({self.healthy_after:.1f}s)[/]")

    def died(self, during: str, wait: float = 2.0) -> ProcessDied | None:
        """If the server has exited (a crash while answering ``during``), the error to raise, with its log tail."""
        if self.proc is None:
            return None
        try:
            rc = self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return None
        return ProcessDied(watch.failure(f"the {self.engine} server {exit_text(rc)} while answering {during}",
                                         self.log_path), hint=f"the whole log is {self.log_path}")

    def running(self) -> bool:
        """Whether any process of the server's group is still alive."""
        if self.proc is None:
            return False
        if self.proc.poll() is None:
            return True
        return _group_alive(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after the grace period; on a second Ctrl-C, SIGKILL at once."""
        if self.proc is None:
            return
        try:
            self._terminate()
        except BaseException:
            watch.signal_group(self.proc.pid, signal.SIGKILL)
            raise

    def _terminate(self) -> None:
        assert self.proc is not None
        pgid = self.proc.pid
        if self.proc.poll() is None or _group_alive(pgid):
            watch.signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(pgid):
                    break
                time.sleep(0.1)
            else:
                watch.signal_group(pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a process stuck in the kernel (D state): nothing more we can do
            raise QuantkitError(f"the {self.engine} server (pid {pgid}) did not exit after SIGKILL") from None
        deadline = time.monotonic() + 5
        while _group_alive(pgid) and time.monotonic() < deadline:  # SIGKILLed stragglers being reaped
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Whether a process group still has a member that is not a zombie.

    ``killpg(pgid, 0)`` also succeeds for zombies waiting to be reaped by init, so the group's members are
    read from /proc where it exists.
    """
    if Path("/proc").is_dir():
        return any(p.pgid == pgid for p in (watch.live_processes() or {}).values())
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _port_taken(path: Path) -> bool:
    text = log_tail(path, 200).lower()
    return "address already in use" in text or "errno 98" in text
