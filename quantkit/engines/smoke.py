"""``quantkit smoke``: prove an artifact serves, in its real engine's OpenAI-compatible server, before release.

An artifact is first checked against its ``quantkit.json`` (:func:`quantkit.integrity.check_intact`, exit 1): a
tampered or damaged one is neither served nor has its results recorded. Then, for each thing to serve (the artifact
folder; for GGUF, each ``.gguf`` file or the one ``--file`` names):

1. doctor first (:func:`quantkit.engines.doctor.check` on the engine's own Python): a known version skew stops here,
   with what is wrong and what to do, before minutes are spent starting a server that cannot load the artifact;
2. start the server (:class:`quantkit.engines.serving.ServerProcess`) and wait for health, showing the wait; a
   server that makes no progress for ``stall_timeout`` seconds is stopped and the run fails with its log's tail;
3. ``GET /v1/models``, then greedy ``POST /v1/completions`` and ``/v1/chat/completions`` (temperature 0, seed 0,
   ``max_tokens`` 16): both answers must be non-empty (chat is skipped for a checkpoint without a chat template);
4. a streamed completion of ``speed_tokens`` tokens (``min_tokens`` keeps it going past an early EOS): time to
   first token, and decode tokens/s over the tokens after the first;
5. with a baseline (``--baseline PATH`` or ``source``: the source model in quantkit.json), transformers generates
   greedily from the same prompt; the served text is tokenized with the baseline's tokenizer and the leading
   ``match_tokens`` tokens are compared. The agreement is recorded, not enforced, unless ``require_match``:
   quantization legitimately moves a near-tie argmax, and on a tiny model that happens within a few tokens, so
   a mismatch alone does not mean the artifact is broken (empty or failing answers do);
   with ``expect``, the chat answer (the completion where the checkpoint has no chat template) must contain that
   text, case-insensitively: a question with one right answer ("What is the capital of France?" -> "Paris") is
   the check that a real instruct model still knows what it knew, which non-empty answers alone cannot show;
6. where the server takes images (a vision-language checkpoint; a GGUF with its mmproj file), one image question,
   the same for every engine (:mod:`quantkit.engines.image_question`): a non-empty answer, an image that took
   prompt tokens, and with a baseline transformers' greedy answer to the same picture and question, recorded;
7. stop the server (always: success, failure, Ctrl-C, SIGTERM) and record the results in quantkit.json's
   ``smoke`` section, keyed by engine (and GGUF file); for an FP4 W4A4 artifact in vLLM, the run's ``numerics``
   (which arithmetic the kernel its log names gives: :mod:`quantkit.engines.numerics`), said in one line.

Tested with llama.cpp b11312's llama-server, llama-cpp-python 0.3.36 (fallback server) and transformers 5.17.0
(baseline) on CPU; written for vLLM 0.26.0.

The server log is written beside the artifact, ``PARENT/NAME.smoke-ENGINE[-FILE].log`` (or into ``--log-dir``),
not inside it: a file added inside would break the artifact's seal until the manifest is updated, which cannot
be done safely while a Ctrl-C is unwinding. It is kept after every run; failures print its last lines.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from quantkit import images, integrity
from quantkit.checkpoint import Fp4, read_config
from quantkit.engines import client, doctor, image_question, numerics, parallel, registry, serving
from quantkit.engines.serving import HOST, ServeOptions, Server, ServerProcess
from quantkit.engines.vllm import kernels
from quantkit.engines.watch import DEFAULT_STALL_TIMEOUT
from quantkit.errors import BackendError, GateFailedError, Interrupted, QuantkitError, UsageError
from quantkit.formats.names import VLLM
from quantkit.locks import output_lock
from quantkit.manifest import MANIFEST, SmokeInfo, now_iso, read_manifest
from quantkit.progress import Reporter
from quantkit.recipe import SmokeSpec

DEFAULT_PROMPT = "The capital of France is"
SEED = 0


@dataclass
class SmokeOptions:
    """Everything ``quantkit smoke`` can be told (the CLI flags; :func:`quantkit.api.smoke`'s keywords)."""

    engine: str = "auto"
    python: str | None = None
    server_cmd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    tp: int = 1
    port: int = 0
    timeout: float = 600.0
    stall_timeout: float = DEFAULT_STALL_TIMEOUT  # seconds without progress before a starting server is stopped
    prompt: str = DEFAULT_PROMPT
    chat_prompt: str | None = None  # the chat request's user message; the completion prompt when unset
    max_tokens: int = 16
    speed_tokens: int = 64
    baseline: str | None = None
    match_tokens: int = 8
    require_match: bool = False
    expect: str | None = None
    file: str | None = None
    image: Path | None = None  # the picture of the image question (the first shipped one when unset)
    image_prompt: str = images.QUESTION
    log_dir: Path | None = None
    check_versions: bool = True

    def check(self) -> None:
        """Refuse a number no run could mean (exit 2), before anything starts: a --port past 65535 ended in a
        traceback, a timeout of -1 s started a server and then blamed the artifact for not answering, a
        --max-tokens of -5 failed on the server's HTTP 400, and a --speed-tokens or --match-tokens of -1 passed
        without measuring or comparing what it says."""
        try:
            _Numbers.model_validate({name: getattr(self, name) for name in _Numbers.model_fields})
        except ValidationError as e:
            raise UsageError("invalid smoke option: " + "; ".join(
                f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']} (got {err.get('input')!r})"
                for err in e.errors())) from None

    def serve_options(self) -> ServeOptions:
        return ServeOptions(python=self.python, server_cmd=self.server_cmd, env=dict(self.env),
                            extra_args=list(self.extra_args), max_model_len=self.max_model_len,
                            gpu_memory_utilization=self.gpu_memory_utilization, tp=self.tp)


class _Numbers(BaseModel):
    """The bounds of :class:`SmokeOptions`' numbers; those the recipe also sets are the recipe's own
    (:class:`quantkit.recipe.SmokeSpec`), so a flag and a recipe field are refused alike."""

    timeout: float = SmokeSpec.model_fields["timeout"]
    stall_timeout: float = SmokeSpec.model_fields["stall_timeout"]
    tp: int = SmokeSpec.model_fields["tp"]
    port: int = Field(ge=0, le=65535)  # 0: a free one is picked
    max_tokens: int = Field(ge=1)
    speed_tokens: int = Field(ge=1)
    match_tokens: int = Field(ge=1)


@dataclass
class SmokeRun:
    """One server started for one target, and what it answered."""

    target: Path
    engine: str
    log: Path | None
    status: str = "failed"  # passed, failed, refused (doctor), interrupted
    data: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    hint: str | None = None

    @property
    def key(self) -> str:
        return f"{self.engine}:{self.target.name}" if self.target.suffix == ".gguf" else self.engine

    def to_json(self) -> dict[str, Any]:
        return {"target": str(self.target), "file": self.target.name if self.target.is_file() else None,
                "engine": self.engine, "status": self.status, "log": str(self.log) if self.log else None, **self.data,
                "error": self.error, "hint": self.hint}


@dataclass
class SmokeResult:
    """All runs of one ``smoke`` call, the doctor report, and the baseline used."""

    path: Path
    engine: str
    runs: list[SmokeRun]
    doctor: dict[str, Any] | None = None
    baseline: dict[str, Any] | None = None
    manifest_updated: bool = False
    tokenizer: Any = None  # the baseline's, to compare served text token by token

    @property
    def ok(self) -> bool:
        return bool(self.runs) and all(r.status == "passed" for r in self.runs)

    def error(self) -> QuantkitError:
        """The error a failed result stands for: which runs failed and why (with each server's log tail) and a
        hint; a baseline mismatch under ``require_match`` alone is a failed gate (exit code 3)."""
        bad = [r for r in self.runs if r.status != "passed"]
        message = "smoke test failed: " + "\n".join(f"{r.target.name} ({r.engine}, {r.status}): {r.error}"
                                                     for r in bad)
        hint = next((r.hint for r in bad if r.hint), None)
        if bad and all(r.data.get("gate") for r in bad):
            return GateFailedError(message, hint=hint)
        return BackendError(message, hint=hint)

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "engine": self.engine, "ok": self.ok,
                "runs": [r.to_json() for r in self.runs], "doctor": self.doctor, "baseline": self.baseline,
                "manifest_updated": self.manifest_updated}


class MatchFailed(BackendError):
    """``require_match``: the served greedy tokens differ from the baseline's (a gate: exit code 3)."""


class ExpectFailed(MatchFailed):
    """``expect``: the served answer does not contain the expected text (a gate: exit code 3)."""


def log_path(path: Path, engine: str, target: Path, log_dir: Path | None) -> Path:
    """Where a run's server log goes: beside the artifact, or the release it is in (or in ``log_dir``), named after
    it and the engine."""
    root = integrity.artifact_of(path) or (path if path.is_dir() else path.parent)  # hf/ of a build-trt one too
    suffix = f"smoke-{engine}" + (f"-{target.stem}" if target.suffix == ".gguf" else "")
    if log_dir is not None:
        return Path(log_dir) / f"{root.name}.{suffix}.log"
    if path.is_dir() or (root / MANIFEST).exists():
        return integrity.beside(root, f"{suffix}.log")  # beside a release that holds it, not in it
    return root / f"{suffix}.log"  # a lone .gguf in a folder that is not an artifact


def run(path: Path, opts: SmokeOptions, reporter: Reporter | None = None) -> SmokeResult:
    """Smoke-test an artifact; returns every run's result (a failed run is data, not an exception).

    Raises :class:`UsageError` for bad input and :class:`Interrupted` on Ctrl-C/SIGTERM (after the server is
    stopped). With ``require_match``, a run whose greedy tokens differ from the baseline is marked failed.
    """
    opts.check()
    rep = reporter or Reporter(quiet=True)
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    root = integrity.artifact_of(path)  # checked before serving it, and before recording into its seal
    checked = integrity.check_intact(root, "smoke-test") if root is not None else None
    engine_name = registry.serving_engine(path) if opts.engine == "auto" else opts.engine
    engine = serving.get(engine_name)
    targets = engine.targets(path, opts.file)
    parallel.check(path, engine, opts.tp)
    if engine.name == VLLM and (why := kernels.vllm_refusal(path)):
        raise UsageError(why, hint="smoke-test its TensorRT-LLM engine: quantkit smoke ARTIFACT --engine trtllm")
    result = SmokeResult(path=path, engine=engine.name, runs=[])
    serve_opts = opts.serve_options()
    python = engine.python(opts.python)

    checks: list[doctor.Check] = []
    if opts.check_versions:
        with rep.step("smoke_doctor", f"Checking {engine.name} in {python} against the artifact"):
            report = doctor.check(path, engine.name, python=opts.python, env=opts.env, include_quantkit=False)
        checks = report.checks
        art = report.artifact or {}
        result.doctor = {"ok": report.ok, "checks": [c.to_json() for c in report.checks],
                         "engine_version": (report.engine or {}).get("version"),
                         "written_with": art.get("written_with"), "read_with": art.get("read_with")}
        for c in report.checks:  # an FP4 artifact's numerics are said once, as the server ran it (_say_numerics)
            if c.status == "warn" and c.name != doctor.NUMERICS_CHECK:
                rep.warn(c.message)
        if not report.ok:
            fails = report.failures()
            for t in targets:
                result.runs.append(SmokeRun(t, engine.name, None, status="refused",
                                            error="; ".join(c.message for c in fails), hint=fails[0].hint))
            result.manifest_updated = _record(path, result, checked)
            return result

    pic = image_question.picture(opts.image) if any(engine.takes_images(t) for t in targets) else None
    if opts.baseline:
        result.baseline, result.tokenizer = baseline_generation(path, opts, rep, pic)

    for target in targets:
        r = SmokeRun(target, engine.name, log_path(path, engine.name, target, opts.log_dir))
        result.runs.append(r)
        r.data["python"] = python
        r.data["tp"] = opts.tp
        r.data["engine_version"] = (result.doctor or {}).get("engine_version")
        try:
            _serve_and_ask(engine, target, python, serve_opts, opts, r, result, rep,
                           pic if engine.takes_images(target) else None)
        except (KeyboardInterrupt, Interrupted) as e:
            r.status = "interrupted"
            raise Interrupted(f"{e or 'stopped by SIGINT'}; the {engine.name} server was stopped; "
                              f"its log is {r.log}") from None
        except UsageError:
            raise  # bad flags (--server-cmd, a busy --port) say nothing about the artifact: not recorded
        except QuantkitError as e:
            r.status, r.error, r.hint = "failed", e.message, e.hint
            r.data["gate"] = isinstance(e, MatchFailed)
        finally:
            r.data["facts"] = engine.log_facts(_read(r.log))
            if engine.name == VLLM and (found := numerics.w4a4(path)):
                _say_numerics(r, found, rep, checks)
        if r.status == "failed":
            rep.console.print(f"[red]✗[/] {target.name}: {r.error.splitlines()[0] if r.error else 'failed'}")
    result.manifest_updated = _record(path, result, checked)
    return result


def _serve_and_ask(engine: Server, target: Path, python: str, serve_opts: ServeOptions,
                   opts: SmokeOptions, r: SmokeRun, result: SmokeResult, rep: Reporter,
                   pic: images.Picture | None) -> None:
    def argv(port: int) -> list[str]:
        return engine.argv(target, python, HOST, port, serve_opts)

    assert r.log is not None
    srv = ServerProcess(engine.name, argv, log_path=r.log, env=serve_opts.env,
                        health_path=engine.health_path_for(argv(0)), port=opts.port, timeout=opts.timeout,
                        stall_timeout=opts.stall_timeout, reporter=rep)
    try:
        with srv:
            r.data["port"] = srv.port
            r.data["healthy_after_s"] = srv.healthy_after
            with rep.step("smoke_requests", f"Asking {engine.name} ({target.name})"):
                try:
                    ask(srv.url, opts, engine, r, chat=engine.has_chat_template(target), pic=pic)
                except BackendError:
                    crash = srv.died(r.data.get("stage", "requests"))
                    if crash is None:
                        raise
                    raise crash from None
    finally:
        r.data["command"] = shlex.join(srv.argv) if srv.argv else None
        r.data["pid"] = srv.proc.pid if srv.proc else None
        r.data["stopped"] = not srv.running()
    if result.baseline is not None:
        r.data["baseline"] = compare(result.baseline, result.tokenizer, r.data["completion"]["text"],
                                     opts.match_tokens)
        seen = (result.baseline.get("image") or {})
        if "image" in r.data and seen:
            r.data["image"]["baseline"] = {"skipped": seen["skipped"]} if "skipped" in seen else \
                compare({**seen, "model": result.baseline["model"]}, result.tokenizer, r.data["image"]["text"],
                        opts.match_tokens)
        if opts.require_match and not r.data["baseline"]["agree"]:
            b = r.data["baseline"]
            raise MatchFailed(f"greedy output differs from the baseline within the first {b['compared']} tokens "
                              f"(matched {b['matched']}): served {b['text']!r}, baseline {b['baseline_text']!r}",
                              hint="drop --require-match to record the agreement without failing")
    r.status = "passed"


def ask(url: str, opts: SmokeOptions, engine: Server, r: SmokeRun, chat: bool = True,
        pic: images.Picture | None = None) -> None:
    """The smoke questions: models, a greedy completion and chat (non-empty), the image question when ``pic`` is
    given, a streamed timing request.

    ``chat=False`` (a checkpoint without a chat template) records the chat question as skipped."""
    timeout = max(60.0, min(opts.timeout, 600.0))
    r.data["stage"] = "GET /v1/models"
    models = client.get_json(url + "/v1/models", timeout=timeout)
    ids = [m.get("id") for m in (models.get("data") or []) if isinstance(m, dict)]
    if not ids:
        raise BackendError(f"GET /v1/models listed no model: {models!r:.500}")
    r.data["models"] = ids
    greedy = {"model": ids[0], "temperature": 0.0, "top_p": 1.0, "seed": SEED, "max_tokens": opts.max_tokens}

    r.data["stage"] = "POST /v1/completions"
    comp = client.post_json(url + "/v1/completions", {**greedy, "prompt": opts.prompt}, timeout=timeout)
    choice = (comp.get("choices") or [{}])[0]
    text = choice.get("text") or ""
    r.data["completion"] = {"prompt": opts.prompt, "text": text, "finish_reason": choice.get("finish_reason"),
                            "completion_tokens": (comp.get("usage") or {}).get("completion_tokens")}
    if not text.strip():
        raise BackendError(f"POST /v1/completions answered an empty completion: {comp!r:.800}")

    if chat:
        r.data["stage"] = "POST /v1/chat/completions"
        answer = client.post_json(url + "/v1/chat/completions",
                                  {**greedy, "messages": [{"role": "user", "content": opts.chat_prompt or opts.prompt}]}, timeout=timeout)
        cchoice = (answer.get("choices") or [{}])[0]
        content = (cchoice.get("message") or {}).get("content") or ""
        r.data["chat"] = {"text": content, "finish_reason": cchoice.get("finish_reason"),
                          "completion_tokens": (answer.get("usage") or {}).get("completion_tokens")}
        if not content.strip():
            raise BackendError(f"POST /v1/chat/completions answered an empty message: {answer!r:.800}")
    else:
        r.data["chat"] = {"skipped": "the checkpoint has no chat template"}
    if opts.expect is not None:
        check_expected(opts.expect, r.data["chat"].get("text", text), "chat answer" if chat else "completion", r)
    if pic is not None:
        r.data["stage"] = "POST /v1/chat/completions (image)"
        r.data["image"] = image_question.ask(url, greedy, pic, opts.image_prompt, timeout)

    r.data["stage"] = "POST /v1/completions (streamed)"
    r.data.update(measure_speed(url, ids[0], opts, engine, timeout))
    del r.data["stage"]


def check_expected(expected: str, answer: str, what: str, r: SmokeRun) -> None:
    """Record whether ``answer`` contains ``expected`` (case-insensitive) and fail the run as a gate if not."""
    found = expected.casefold() in answer.casefold()
    r.data["expect"] = {"text": expected, "in": what, "found": found}
    if not found:
        raise ExpectFailed(f"the {what} does not contain {expected!r}: {answer!r:.300}",
                           hint="the artifact answers, but not what the source model answers; score it with "
                                "`quantkit eval` to see how much it lost")


def measure_speed(url: str, model: str, opts: SmokeOptions, engine: Server,
                  timeout: float) -> dict[str, Any]:
    """Time to first token and decode tokens/s of one streamed greedy completion (batch 1): the decode rate by the
    server's own clock where it reports one (:meth:`Server.own_decode_rate`), else by the events' arrival here."""
    payload = {"model": model, "prompt": opts.prompt, "temperature": 0.0, "seed": SEED,
               "max_tokens": opts.speed_tokens, "stream_options": {"include_usage": True},
               **engine.speed_extra(opts.speed_tokens)}
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = own = None
    for t, ev in client.stream(url + "/v1/completions", payload, timeout=timeout):
        own = engine.own_decode_rate(ev) or own
        for ch in ev.get("choices") or []:
            if ch.get("text"):
                chunks += 1
                first = first if first is not None else t
                last = t
        if ev.get("usage"):
            usage_tokens = ev["usage"].get("completion_tokens")
    if first is None or last is None:
        raise BackendError("the streamed completion produced no text")
    tokens = usage_tokens or chunks
    decode = own or ((tokens - 1) / (last - first) if tokens > 1 and last > first else None)
    return {"ttft_s": round(first - t0, 4), "stream_tokens": tokens,
            "decode_tokens_per_s": round(decode, 1) if decode else None,
            "decode_clock": "server" if own else "client"}


def baseline_model(path: Path, baseline: str) -> Path:
    """``--baseline``: a model folder, or ``source`` for the source model recorded in the artifact's manifest."""
    if baseline != "source":
        p = Path(baseline).expanduser()
        if not (p / "config.json").exists():
            raise UsageError(f"--baseline {baseline}: no Hugging Face checkpoint there (config.json)",
                             hint="pass the source model's folder, or 'source' to use the one in quantkit.json")
        return p
    root = path if path.is_dir() else path.parent
    src = read_manifest(root).source
    local = src.local_path()
    if local is None:
        raise UsageError(f"--baseline source: {root}'s manifest names no source model on this machine "
                         f"({src.id}, {src.path})", hint="pass --baseline PATH to the source model's folder")
    return local


def baseline_generation(path: Path, opts: SmokeOptions, rep: Reporter,
                        pic: images.Picture | None = None) -> tuple[dict[str, Any], Any]:
    """Greedy continuation of the prompt by the unquantized model, in transformers (before any server starts,
    so the GPU is free for the engine afterwards); with ``pic``, also its answer to the image question (a
    vision-language model is loaded as ``AutoModelForImageTextToText`` for both)."""
    from quantkit.versions import require

    torch = require("torch", "eval", "the --baseline comparison")
    transformers = require("transformers", "eval", "the --baseline comparison")
    model_dir = baseline_model(path, opts.baseline or "source")
    with rep.step("smoke_baseline", f"Greedy baseline from {model_dir} (transformers)"):
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # float32 on CPU: the reference should be the most exact greedy path, not bf16 CPU kernels
        dtype = "auto" if device == "cuda" else torch.float32
        vlm = bool(read_config(model_dir).get("vision_config"))
        auto = transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM
        model = auto.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        enc = tok(opts.prompt, return_tensors="pt").to(device)
        gen = transformers.GenerationConfig(max_new_tokens=opts.max_tokens, do_sample=False,
                                            eos_token_id=model.generation_config.eos_token_id,
                                            pad_token_id=tok.pad_token_id or tok.eos_token_id)
        with torch.no_grad():
            out = model.generate(**enc, generation_config=gen)
        ids = out[0, enc["input_ids"].shape[1]:].tolist()
        seen = image_question.baseline_answer(model, tok, model_dir, pic, opts.image_prompt, opts.max_tokens,
                                              device) if pic is not None and vlm else None
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    info = {"model": str(model_dir), "prompt": opts.prompt, "ids": ids,
            "text": tok.decode(ids, skip_special_tokens=True), **({"image": seen} if seen else {})}
    return info, tok


def compare(baseline: dict[str, Any], tok: Any, served_text: str, match_tokens: int) -> dict[str, Any]:
    """How many leading tokens of the served greedy text equal the baseline's (in the baseline's tokenizer)."""
    base_ids = [i for i in baseline["ids"] if i not in set(tok.all_special_ids)]
    served_ids = tok(served_text, add_special_tokens=False)["input_ids"]
    n = min(match_tokens, len(base_ids))
    matched = 0
    for a, b in zip(base_ids[:n], served_ids[:n]):
        if a != b:
            break
        matched += 1
    return {"model": baseline["model"], "compared": n, "matched": matched, "agree": matched >= n,
            "text": served_text, "baseline_text": baseline["text"]}


def _say_numerics(r: SmokeRun, found: Fp4, rep: Reporter, checks: list[doctor.Check]) -> None:
    """Record, and say in one line, which arithmetic vLLM served a W4A4 FP4 artifact with (from the kernels its log
    names: Marlin FP4 runs it weight-only); where the log names none (a server that died first), doctor's
    prediction from the GPU is said instead."""
    label = numerics.of_vllm_kernels(k for _, k in kernels.log_facts(_read(r.log)).linear)
    if label is None:
        for c in checks:
            if c.name == doctor.NUMERICS_CHECK:
                (rep.warn if c.status == "warn" else rep.log)(c.message)
        return
    r.data["numerics"] = label
    say = rep.warn if label == numerics.MARLIN_WEIGHT_ONLY else rep.log
    say(f"{r.target.name}: {numerics.line(found, label, 'vLLM')}")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _record(path: Path, result: SmokeResult, checked: integrity.VerifyResult | None) -> bool:
    """Merge the runs into the artifact's manifest ``smoke`` section (when it is a quantkit artifact); ``checked``:
    the artifact's verification before serving, whose unchanged files are not hashed again."""
    root = integrity.artifact_of(path)  # the artifact a folder inside it belongs to (a build-trt one's hf/)
    if root is None:
        return False
    now = now_iso()
    with output_lock(root, wait=True):
        current = read_manifest(root).smoke
        runs = dict(current.runs) if current else {}
        for r in result.runs:
            entry = r.to_json()
            entry.pop("target", None)
            entry["when"] = now
            runs[r.key] = entry
        integrity.update_manifest(root, smoke=SmokeInfo(updated=now, runs=runs), checked=checked)
    return True
