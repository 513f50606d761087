"""A serving benchmark a release engineer reads (issue 44 item 4): each artifact and its bf16 reference behind the
engine's real OpenAI server, driven at several concurrency levels of streamed ``/v1/completions``, with time to
first token, inter-token latency and output tokens/s, and each figure's ratio to the reference at the same level.
It answers "how much faster is this format, at my batch size, in my engine".

    python bench/serve_bench.py --engine vllm --python VLLM_PY --reference W/src-8b W/out-quantkit-gptq ...
    python bench/serve_bench.py --engine sglang --python SGLANG_PY --reference W/src-8b W/out-quantkit-fp8-static
    python bench/serve_bench.py --engine llama.cpp --reference OUT/F16.gguf OUT/Q4_K_M.gguf --tokenizer SRC \
        --concurrency 1,2 --prompt-len 64 --gen 32 --name smollm2_llamacpp_cpu

Each checkpoint gets its own server, started the way ``quantkit smoke`` starts it
(:mod:`quantkit.engines.serving`: the engine's command, a free loopback port, a process group that never outlives
this script), made a deployment's where smoke's differs: vLLM and SGLang with CUDA graphs on for every batch up to
the largest level (``bench/engine_speed.py``'s flags, the capture list widened), llama-server with one slot per
request of the largest level (``--parallel``) and the context they share. Then, after one warm-up round at the
largest level, for each level C: C clients, each sending ``--rounds`` requests one after another (a closed loop:
C requests always in flight), every request a fresh window of ``--prompt-len`` token ids cut from the held-out
text (no two requests share a prefix, so no prefix cache helps), ``max_tokens`` = ``--gen`` with ``ignore_eos``
(every request decodes exactly that many tokens, checked), greedy, streamed.

From the arrival time of every streamed chunk:

* TTFT: first chunk - send, per request; p50 and p90 over the level's requests.
* ITL (inter-token latency): the gaps between consecutive chunks of a request, p50 and p90 over every gap of the
  level; TPOT, each request's (last - first) / (tokens - 1), is in the JSON beside it.
* output tokens/s: every output token of the level over the level's wall time (first send to last answer).

Writes ``bench/results/NAME/{results.json,results.md,results.png}`` (the plot: tokens/s, TTFT p50 and ITL p50
against concurrency, one line per checkpoint and engine) after every checkpoint. The engine's Python is found as
quantkit finds it (``--python``, its variable, its script on PATH: quantkit/envs.py); ``--engine-path DIR`` puts a
``pip install --target`` folder on the server's PYTHONPATH.

Every checkpoint is checked before any server starts (a .gguf file for llama.cpp, a folder with config.json for the
others): a bad path is refused in one line, naming it. A checkpoint whose server fails (will not start, stops
answering, decodes fewer tokens than asked) gets a row that says it failed, its error's first line in a list under
the table (the whole error, a server's log tail with it, in the JSON), and the rest run; an error quantkit did not
foresee is recorded the same way, its traceback printed, and the script exits 1 at the end.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta  # noqa: E402

sys.path.insert(0, str(meta.ROOT))
from quantkit.engines import client, registry, serving  # noqa: E402
from quantkit.engines.serving import HOST, ServeOptions, ServerProcess  # noqa: E402
from quantkit.errors import BackendError, QuantkitError  # noqa: E402
from quantkit.progress import Reporter, use  # noqa: E402
from quantkit.recipe import DEFAULT_STALL_TIMEOUT, NO_PROGRESS  # noqa: E402

HELDOUT = meta.ROOT / "calibration" / "heldout.jsonl.gz"
ENGINES = ("vllm", "sglang", "llama.cpp")


# ----------------------------------------------------------------------------------------------------------------
# The arithmetic, on recorded stream timings (tests/test_bench_serve.py)


@dataclass
class Stream:
    """One streamed request: when it was sent, when each chunk arrived (perf_counter seconds) and how many output
    tokens the server says it produced."""

    sent: float
    arrivals: list[float]
    tokens: int


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(streams: list[Stream], wall_s: float) -> dict[str, Any]:
    """One concurrency level's figures from its requests' timings (seconds in, milliseconds out)."""
    ttft = [s.arrivals[0] - s.sent for s in streams if s.arrivals]
    gaps = [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:])]
    tpot = [(s.arrivals[-1] - s.arrivals[0]) / (s.tokens - 1) for s in streams if s.tokens > 1 and s.arrivals]
    tokens = sum(s.tokens for s in streams)
    ms = lambda x: None if x is None else round(x * 1000, 3)  # noqa: E731
    return {"requests": len(streams), "output_tokens": tokens, "wall_s": round(wall_s, 4),
            "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
            "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p90": ms(percentile(ttft, 90)),
            "itl_ms_p50": ms(percentile(gaps, 50)), "itl_ms_p90": ms(percentile(gaps, 90)),
            "tpot_ms_mean": ms(sum(tpot) / len(tpot)) if tpot else None}


RATIO_KEYS = ("output_tokens_per_s", "ttft_ms_p50", "itl_ms_p50")


def ratios(row: dict[str, Any], reference: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Each level's figures over the reference's at the same level (tokens/s above 1 is faster; TTFT and ITL below
    1 are faster)."""
    out: dict[str, dict[str, float | None]] = {}
    for level, fig in row["levels"].items():
        ref = reference["levels"].get(level)
        if ref is None:
            continue
        out[level] = {k: (round(fig[k] / ref[k], 3) if fig.get(k) and ref.get(k) else None) for k in RATIO_KEYS}
    return out


# ----------------------------------------------------------------------------------------------------------------
# Prompts and requests


def prompt_windows(tokenizer: Any, length: int, count: int) -> list[list[int]]:
    """``count`` windows of ``length`` token ids, none overlapping, from the held-out text (repeated if short)."""
    with gzip.open(HELDOUT, "rt", encoding="utf-8") as f:
        ids = [t for line in f if line.strip()
               for t in tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]]
    need = length * count
    ids = (ids * (need // max(len(ids), 1) + 1))[:need]
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def one_request(url: str, model: str, prompt: list[int], gen: int, timeout: float) -> Stream:
    """A streamed completion of exactly ``gen`` tokens; every chunk's arrival time recorded."""
    payload = {"model": model, "prompt": prompt, "max_tokens": gen, "min_tokens": gen, "ignore_eos": True,
               "temperature": 0.0, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage = None
    for at, event in client.stream(url + "/v1/completions", payload, timeout=timeout):
        if event.get("usage"):
            usage = int(event["usage"].get("completion_tokens") or 0)
        if any("text" in c for c in event.get("choices") or []):
            arrivals.append(at)
    tokens = usage if usage else len(arrivals)
    if tokens != gen:  # a server that stops early: its row says so, and the other checkpoints still run
        raise BackendError(f"asked {gen} tokens, the server produced {tokens} (usage {usage}, {len(arrivals)} chunks)")
    return Stream(sent, arrivals, tokens)


def run_level(url: str, model: str, prompts: list[list[int]], concurrency: int, gen: int,
              timeout: float) -> tuple[list[Stream], float]:
    """``concurrency`` clients in a closed loop over ``prompts`` (len = concurrency x rounds): the streams and the
    level's wall time."""
    rounds = len(prompts) // concurrency

    def client_loop(k: int) -> list[Stream]:
        return [one_request(url, model, prompts[k * rounds + r], gen, timeout) for r in range(rounds)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        streams = [s for batch in pool.map(client_loop, range(concurrency)) for s in batch]
    return streams, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------------------------
# Servers


def deployment_args(engine: str, top: int, prompt_len: int, gen: int) -> tuple[list[str], int]:
    """What turns smoke's server into a deployment's for concurrency up to ``top`` (appended: the last flag wins),
    and the context length to ask for."""
    ctx = prompt_len + gen + 16
    if engine == "vllm":
        sizes = sorted({1, 2, 4, 8, *[min(2 ** k, top) for k in range(int(math.log2(max(top, 1))) + 1)], top})
        return ["--no-enforce-eager", "--compilation-config", json.dumps({"cudagraph_capture_sizes": sizes}),
                "--max-num-seqs", str(max(top, 16))], ctx
    if engine == "sglang":
        return ["--cuda-graph-backend-decode", "full", "--cuda-graph-max-bs-decode", str(max(top, 16)),
                "--max-running-requests", str(max(top, 16))], ctx
    return ["--parallel", str(top), "--ctx-size", str(ctx * top)], ctx  # llama-server: one slot per request


def unservable(paths: list[Path], engine: str) -> list[str]:
    """Each of ``paths`` that ``engine`` cannot be started on, with why: llama.cpp serves a .gguf file, the others a
    Hugging Face folder whose config.json :func:`label` reads. Asked of every checkpoint before any server starts, so
    that a mistyped path is not found after minutes of other servers."""
    bad = []
    for path in dict.fromkeys(paths):
        why = ""
        if engine == "llama.cpp":
            why = "not a .gguf file" if path.suffix != ".gguf" else "" if path.is_file() else "no such file"
        elif not path.is_dir():
            why = "not a folder" if path.exists() else "no such folder"  # a .gguf given to vLLM is there
        else:
            try:
                json.loads((path / "config.json").read_text())
            except OSError:
                why = "no config.json in it"
            except json.JSONDecodeError:
                why = "its config.json is not JSON"
        if why:
            bad.append(f"{path} ({why})")
    return bad


def model_name(path: Path) -> str:
    """The model a run measures, for the default title: the reference's folder name or its GGUF file's stem (its
    :func:`label` is a dtype, "bf16", which names no model)."""
    path = Path(os.path.abspath(path))  # "." has a name once absolute; a link keeps the name it was given
    return path.stem if path.suffix == ".gguf" else path.name


def label(path: Path) -> str:
    """The row's name: a GGUF file's name, quantkit's method and scheme for its artifacts, the dtype otherwise."""
    if path.suffix == ".gguf":
        return path.stem
    cfg = json.loads((path / "config.json").read_text())
    if not cfg.get("quantization_config"):
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "")
        return {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype or path.name)
    try:
        m = json.loads((path / "quantkit.json").read_text())
        return f"{m.get('method')} {(m.get('quantization') or {}).get('scheme') or ''}".strip()
    except (OSError, json.JSONDecodeError):
        return path.name


def measure(engine: str, path: Path, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """One checkpoint behind one server: start, warm up, every level, stop."""
    server = serving.get(engine)
    extra, ctx = deployment_args(engine, max(args.concurrency), args.prompt_len, args.gen)
    opts = ServeOptions(python=args.python, max_model_len=ctx, gpu_memory_utilization=args.gpu_memory_utilization)
    env = {"PYTHONPATH": args.engine_path} if args.engine_path else {}
    log = args.logs / f"{engine}-{path.stem if path.suffix == '.gguf' else path.name}.log"
    row: dict[str, Any] = {"engine": engine, "checkpoint": label(path), "path": str(path), "log": str(log),
                           "levels": {}}
    argv = lambda port: server.command(path, args.python, HOST, port, opts) + extra + args.server_arg  # noqa: E731
    t0 = time.perf_counter()
    with ServerProcess(engine, argv, log_path=log, env=env, health_path=server.health_path,
                       timeout=args.timeout, stall_timeout=args.stall_timeout) as srv:
        row["healthy_after_s"] = round(time.perf_counter() - t0, 1)
        row["command"] = srv.argv
        model = client.get_json(srv.url + "/v1/models")["data"][0]["id"]
        top = max(args.concurrency)
        run_level(srv.url, model, prompts[:top], top, args.gen, args.timeout)  # warm-up: one request per client
        start = top
        for c in args.concurrency:
            batch = prompts[start:start + c * args.rounds]
            start += c * args.rounds
            streams, wall = run_level(srv.url, model, batch, c, args.gen, args.timeout)
            row["levels"][str(c)] = summarize(streams, wall)
            print(f"   c={c}: {row['levels'][str(c)]}", flush=True)
        row["log_facts"] = server.log_facts(log.read_text(errors="replace"))
    return row


# ----------------------------------------------------------------------------------------------------------------
# Results


def first_line(error: str) -> str:
    """What a failed row's error says in one line (the rest is a log's tail or a hint). A line that ends by
    introducing what follows (a server's error: "... Last lines of LOG:", then the tail) says where that is, the
    JSON, rather than end on a colon with nothing after it."""
    line, _, rest = error.partition("\n")
    if line.endswith(":"):
        line = line[:-1] + (" (in results.json)" if rest.strip() else "")
    return line


def _cell(x: float | None, ratio: float | None, digits: int) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def markdown(data: dict[str, Any]) -> str:
    """One table per engine: a row per checkpoint and level, each figure with its ratio to the reference. A failed
    checkpoint's row says only that it failed; the first line of its error, whole, is listed under the table, where it
    is not cut mid-word to fit a cell (the JSON has the rest)."""
    lines = [f"# Serving benchmark: {data['title']}", "", meta.md_header(data),
             f"Streamed `/v1/completions`, prompts of {data['prompt_len']} held-out token ids (no shared prefixes), "
             f"{data['gen']} output tokens per request (ignore_eos), greedy; C clients in a closed loop, "
             f"{data['rounds']} requests each, after one warm-up round. Ratios in brackets are against "
             f"`{data['reference']}` in the same engine at the same concurrency (tokens/s: above 1 is faster; TTFT "
             "and ITL: below 1 is faster). Load average when it started: "
             + ", ".join(f"{x:.1f}" for x in data["load_average"]) + (f". {data['note']}" if data.get("note") else "."),
             ""]
    for engine in dict.fromkeys(r["engine"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["engine"] == engine]
        ref = next((r for r in rows if r["path"] == data["reference_path"]), None)
        lines += [f"## {engine}", "", "| checkpoint | concurrency | output tok/s | TTFT p50 ms | TTFT p90 ms | "
                  "ITL p50 ms | ITL p90 ms |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("error"):
                lines.append(f"| {r['checkpoint']} | - | failed: see below | | | | |")
                continue
            rat = ratios(r, ref) if ref is not None and r is not ref else {}
            for level, f in r["levels"].items():
                q = rat.get(level, {})
                lines.append(f"| {r['checkpoint']} | {level} | "
                             f"{_cell(f['output_tokens_per_s'], q.get('output_tokens_per_s'), 1)} | "
                             f"{_cell(f['ttft_ms_p50'], q.get('ttft_ms_p50'), 1)} | "
                             f"{_cell(f['ttft_ms_p90'], None, 1)} | {_cell(f['itl_ms_p50'], q.get('itl_ms_p50'), 2)} | "
                             f"{_cell(f['itl_ms_p90'], None, 2)} |")
        lines.append("")
        if failed := [r for r in rows if r.get("error")]:
            lines += ["Failed:", "", *[f"- {r['checkpoint']} (`{r['path']}`): {first_line(r['error'])}"
                                       for r in failed], ""]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> str | None:
    """tokens/s, TTFT p50 and ITL p50 against concurrency; None when drawn, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed in this Python: no plot"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("output_tokens_per_s", "output tokens/s"), ("ttft_ms_p50", "TTFT p50 (ms)"),
              ("itl_ms_p50", "inter-token latency p50 (ms)"))
    for ax, (key, title) in zip(axes, panels):
        for r in data["rows"]:
            if not r["levels"]:
                continue
            xs = [int(c) for c in r["levels"]]
            ax.plot(xs, [r["levels"][str(c)][key] for c in xs], marker="o", label=f"{r['checkpoint']} ({r['engine']})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["concurrency"], [str(c) for c in data["concurrency"]])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(data["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(data: dict[str, Any], folder: Path) -> None:
    meta.write("results", data, markdown(data), folder)
    why = plot(data, folder / "results.png")
    if why:
        data["plot"] = why
        meta.write("results", data, markdown(data), folder)


def main() -> None:
    ap = meta.serving_parser(__doc__, checkpoints="artifacts (folders, or .gguf files for llama.cpp)",
                             engine="the engine's", engine_path="--engine-path", timeout=900.0,
                             timeout_help="seconds to health, and per request", name="serve_bench",
                             name_help="results folder under --results-dir")
    ap.add_argument("--reference", type=Path, required=True, help="the bf16 (or F16/Q8_0 GGUF) reference")
    ap.add_argument("--engine", type=lambda s: s.split(","), default=["vllm"],
                    help=f"comma-separated, from {', '.join(ENGINES)}")
    ap.add_argument("--tokenizer", type=Path, help="where the prompts' tokenizer is [default: the reference]")
    ap.add_argument("--concurrency", type=meta.int_list, default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=4, help="requests each client sends per level")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--server-arg", action="append", default=[], help="one more server flag (repeat)")
    ap.add_argument("--title", help="the table's title [default: the reference's folder name, or its .gguf's stem]")
    ap.add_argument("--note", default="", help="a sentence for the table (the machine, if it matters)")
    ap.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "quantkit-serve-bench")
    ap.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT,
                    help=f"seconds a starting server may go without progress ({NO_PROGRESS}) before it is stopped, "
                         "as smoke's --stall-timeout; 0: never. A first "
                         "start that compiles kernels can be silent for minutes (SGLang's W4A16: 243 s on an H100, "
                         f"bench/results/h100/8b/) [default: {DEFAULT_STALL_TIMEOUT:g}]")
    args = ap.parse_args()
    # The Python API waits quietly; the benchmark's log says what each server start waits on, as the CLI does: a
    # first start can build kernels for minutes (its wait line says "compiling (cicc)", on stderr every 15 s).
    use(Reporter())
    bad = [e for e in args.engine if e not in ENGINES]
    if bad or len(args.engine) != 1 and args.python:
        ap.error(f"unknown engine {', '.join(bad)}" if bad else "--python names one engine's Python: one --engine")
    for engine in args.engine:
        if unusable := unservable([args.reference, *args.checkpoints], engine):
            ap.error(f"{engine} cannot serve {'; '.join(unusable)}")
    from transformers import AutoTokenizer

    tok_dir = args.tokenizer or (args.reference if args.reference.is_dir() else None)
    if tok_dir is None:
        ap.error("a GGUF reference needs --tokenizer (the Hugging Face folder it was made from)")
    per_server = max(args.concurrency) + sum(c * args.rounds for c in args.concurrency)
    prompts = prompt_windows(AutoTokenizer.from_pretrained(str(tok_dir)), args.prompt_len, per_server)
    args.logs.mkdir(parents=True, exist_ok=True)
    folder = args.results_dir / args.name
    data: dict[str, Any] = {**meta.header(), "title": args.title or model_name(args.reference),
                            "reference": label(args.reference), "reference_path": str(args.reference),
                            "prompt_len": args.prompt_len, "gen": args.gen, "rounds": args.rounds,
                            "concurrency": args.concurrency, "note": args.note, "load_average": os.getloadavg(),
                            "rows": []}
    engines, unexpected = args.engine, []
    for engine in engines:
        args.python = registry.get(engine).find_python(args.python if len(engines) == 1 else None).python
        for path in [args.reference, *[c for c in args.checkpoints if c != args.reference]]:
            print(f"== {engine}: {path}", flush=True)
            try:
                data["rows"].append(measure(engine, path, args, prompts))
            except Exception as e:  # a server that would not start or answered wrongly: its row says so, the rest run
                error = str(e) if isinstance(e, QuantkitError) else f"{type(e).__name__}: {e}"
                data["rows"].append({"engine": engine, "checkpoint": label(path), "path": str(path), "levels": {},
                                     "error": error})  # whole: a server's error goes on with its log's last lines
                print(f"   {first_line(error)}", flush=True)
                if not isinstance(e, QuantkitError):  # not one quantkit foresaw: maybe this script's bug
                    traceback.print_exc()
                    unexpected.append(f"{engine} {path}")
            write(data, folder)
    print(markdown(data))
    if unexpected:
        sys.exit(f"error: an unexpected error (its traceback above) ended the run of {', '.join(unexpected)}")


if __name__ == "__main__":
    main()
