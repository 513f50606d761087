"""Decode speed of one checkpoint in one engine's HTTP server, as deployed (CUDA graphs on), at batch 1 and 16: the
figure that lets SGLang and vLLM be compared on the same checkpoint (issue 28 item 3).

``quantkit smoke`` measures a streamed completion at batch 1 with CUDA graphs off (a server that is healthy sooner);
that is a smoke figure, not what a deployment decodes at. This script starts the engine's server through quantkit's
own command line (:mod:`quantkit.engines.serving`) with graphs turned back on:

* vLLM 0.26: ``--no-enforce-eager`` (its boolean flags take the ``--no-`` form; the last one given wins) and
  ``--compilation-config '{"cudagraph_capture_sizes": [1, 2, 4, 8, 16]}'``: graphs for the measured batch sizes
  and the ones a ramping batch passes through, not vLLM's ~60 sizes, which take minutes to capture.
* SGLang 0.5.17: ``--cuda-graph-backend-decode full --cuda-graph-max-bs-decode 16`` (prefill stays eager; it is
  outside the decode figure).

Then, over the OpenAI ``/v1/completions`` route both engines serve, with fresh random token-id prompts every call
(no prefix-cache hits), ``ignore_eos`` and ``min_tokens`` so every request decodes exactly ``--gen`` tokens:

* TTFT: the median of 5 batch-1 calls with ``max_tokens=1``.
* decode tok/s at batch B: B concurrent requests of ``--gen`` tokens, timed from the first send to the last answer;
  the time of the same B requests with ``max_tokens=1`` (median of 3) is subtracted, so the figure is
  B x (gen - 1) tokens over decode time alone (median of 3). HTTP and tokenization cost the same in both engines'
  figures; the offline figures of bench/serve_speed.py leave them out.

    python3 bench/engine_speed.py MODEL --engine sglang --server-arg=--attention-backend --server-arg=triton
    python3 bench/engine_speed.py MODEL --engine vllm --gpu-memory-utilization 0.5

The engine's Python is found as quantkit finds it (``--python``, else QUANTKIT_SGLANG_PYTHON / QUANTKIT_VLLM_PYTHON,
else the interpreter of the engine's script on PATH, else this one: quantkit/envs.py).

Prints one JSON object (command, versions, server start time, the figures per batch).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quantkit.checkpoint import read_config  # noqa: E402
from quantkit.engines import client, registry, serving  # noqa: E402
from quantkit.engines.serving import HOST, ServeOptions, ServerProcess  # noqa: E402
from quantkit.progress import Reporter, use  # noqa: E402

# What turns each engine's smoke defaults (graphs off) into a deployment's (graphs on, for batches up to 16).
GRAPHS_ON = {
    "vllm": ["--no-enforce-eager", "--compilation-config", json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})],
    "sglang": ["--cuda-graph-backend-decode", "full", "--cuda-graph-max-bs-decode", "16"],
}
TTFT_CALLS = 5
REPEATS = 3


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    """Fresh random token ids (away from the special tokens at both ends of the vocabulary)."""
    return [[rng.randrange(100, vocab - 300) for _ in range(length)] for _ in range(n)]


def run_batch(url: str, model: str, batch: list[list[int]], max_tokens: int, timeout: float) -> float:
    """Seconds from the first send to the last answer of ``len(batch)`` concurrent completions."""
    def one(ids: list[int]) -> int:
        out = client.post_json(url + "/v1/completions",
                               {"model": model, "prompt": ids, "max_tokens": max_tokens, "min_tokens": max_tokens,
                                "ignore_eos": True, "temperature": 0.0}, timeout=timeout)
        return int((out.get("usage") or {}).get("completion_tokens") or 0)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        counts = list(pool.map(one, batch))
    secs = time.perf_counter() - t0
    if any(c != max_tokens for c in counts):
        raise SystemExit(f"error: asked {max_tokens} tokens per request, the server produced {counts}")
    return secs


def measure(url: str, model: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(0)
    fresh = lambda n: prompts(rng, n, args.prompt_len, vocab)  # noqa: E731
    run_batch(url, model, fresh(max(args.batches)), args.gen, args.timeout)  # warm-up at the largest batch
    ttft = statistics.median(run_batch(url, model, fresh(1), 1, args.timeout) for _ in range(TTFT_CALLS))
    rows = {}
    for b in args.batches:
        first = statistics.median(run_batch(url, model, fresh(b), 1, args.timeout) for _ in range(REPEATS))
        full = [run_batch(url, model, fresh(b), args.gen, args.timeout) for _ in range(REPEATS)]
        rates = [b * (args.gen - 1) / max(t - first, 1e-9) for t in full]
        rows[str(b)] = {"decode_tokens_per_s": round(statistics.median(rates), 1),
                        "runs_tokens_per_s": [round(r, 1) for r in rates],
                        "first_token_s": round(first, 4), "full_s": [round(t, 3) for t in full]}
    return {"ttft_s": round(ttft, 4), "batches": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--engine", choices=sorted(GRAPHS_ON), required=True)
    ap.add_argument("--python", help="the engine's Python [default: quantkit's rule, quantkit/envs.py]")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--gen", type=int, default=256, help="tokens decoded per request")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--server-arg", action="append", default=[], help="one more server flag (repeat)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to health, and per request")
    ap.add_argument("--log", type=Path, default=None, help="the server's log (default: a temporary file)")
    args = ap.parse_args()
    use(Reporter())  # the server's start shows its wait on stderr, as under the CLI (the API waits quietly)
    args.python = registry.get(args.engine).find_python(args.python).python

    server = serving.get(args.engine)
    opts = ServeOptions(python=args.python, max_model_len=args.max_model_len,
                        gpu_memory_utilization=args.gpu_memory_utilization)
    extra = GRAPHS_ON[args.engine] + args.server_arg
    log = args.log or Path(tempfile.mkstemp(prefix=f"engine-speed-{args.engine}-", suffix=".log")[1])
    argv = lambda port: server.command(args.model, args.python, HOST, port, opts) + extra  # noqa: E731
    cfg = read_config(args.model)
    vocab = int((cfg.get("text_config") or cfg)["vocab_size"])
    t0 = time.perf_counter()
    with ServerProcess(args.engine, argv, log_path=log, health_path=server.health_path,
                       timeout=args.timeout) as srv:
        healthy = time.perf_counter() - t0
        model = client.get_json(srv.url + "/v1/models")["data"][0]["id"]
        figures = measure(srv.url, model, args, vocab)
        facts = server.log_facts(log.read_text(errors="replace"))
        command = srv.argv
    print(json.dumps({"engine": args.engine, "model": str(args.model), "command": command, "healthy_after_s":
                      round(healthy, 1), "gen": args.gen, "prompt_len": args.prompt_len, "log": str(log),
                      "log_facts": facts, **figures}, indent=1))


if __name__ == "__main__":
    main()
