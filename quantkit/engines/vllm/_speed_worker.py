"""Load one checkpoint in vLLM's offline ``LLM`` and time it: TTFT and decode tokens/s at given batch sizes.

Run by :mod:`quantkit.engines.vllm.kernel_sweep` with vLLM's own Python, as a plain file: it imports only the standard
library and vLLM (never quantkit), so vLLM may live in an environment of its own. The kernel configuration
reaches it as environment variables (``VLLM_DISABLED_KERNELS``...) and engine arguments (``linear_backend``...),
which is why each configuration is a fresh process. Written against vLLM 0.26.0's V1 offline API.

Protocol: ``python _speed_worker.py REQUEST.json``; the last stdout line starting with ``RESULT `` is the JSON
result (``{"error": ...}`` when loading or generating failed). Request fields: ``model``, ``engine_args`` (for
``vllm.LLM``), ``batches``, ``prompt_len``, ``gen``, ``ttft_repeats``, ``decode_repeats``, ``sample_prompt``,
``sample_tokens``.

Protocol of the timing (greedy, ``ignore_eos``, prefix caching off so a repeated prompt costs what a new one does,
fresh random token-id prompts of ``prompt_len`` from a fixed seed):

* one warm-up generation at the largest batch with ``gen`` tokens (CUDA graphs, autotuning, JIT kernels);
* TTFT: median of ``ttft_repeats`` calls of one prompt with ``max_tokens=1`` (prefill plus the first token);
* decode tok/s at batch B: B prompts generate ``gen`` tokens, ``decode_repeats`` times (3 unless asked: one
  generation of 128 tokens at batch 1 is a quarter of a second on an H200, and two single timings of one artifact
  differed by 32%); the median time of the same call with ``max_tokens=1`` (3 runs) is subtracted from the median
  of those, so the figure is B x (gen - 1) tokens over pure decode time, with every run's figure beside it;
* a greedy sample of ``sample_tokens`` from a fixed text prompt, to see that the output is not garbage.
"""

import json
import os
import sys
import time
import traceback

# Run as a script, this folder is sys.path[0], where quantkit's own modules (kernels.py...) would shadow packages of
# the same name that vLLM and its dependencies import.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def measure(req):
    import random

    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    args = {"seed": 0, "enable_prefix_caching": False, **req.get("engine_args", {})}
    llm = LLM(model=req["model"], **args)
    out = {"load_s": round(time.perf_counter() - t0, 2), "vllm": vllm.__version__}
    cfg = llm.llm_engine.model_config
    out["quantization"] = cfg.quantization
    out["dtype"] = str(cfg.dtype)
    try:
        import torch

        out["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # the device name is informative only
        pass
    vocab = cfg.get_vocab_size()
    try:
        vocab = min(vocab, llm.get_tokenizer().max_token_id + 1)  # a random-weight model may outgrow its tokenizer
    except Exception:  # older tokenizer wrappers: the model's vocabulary is the bound vLLM checks anyway
        pass
    rng = random.Random(0)
    low = min(100, vocab // 4)
    prompt_len, gen = int(req["prompt_len"]), int(req["gen"])
    batches = [int(b) for b in req["batches"]]

    def prompts(n):
        return [{"prompt_token_ids": [rng.randrange(low, vocab) for _ in range(prompt_len)]} for _ in range(n)]

    def timed(n, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        res = llm.generate(prompts(n), sp, use_tqdm=False)
        return time.perf_counter() - t, sum(len(r.outputs[0].token_ids) for r in res)

    timed(max(batches), gen)
    out["ttft_s"] = _median(timed(1, 1)[0] for _ in range(int(req.get("ttft_repeats", 5))))
    out["batches"] = {}
    for b in batches:
        first = _median(timed(b, 1)[0] for _ in range(3))
        runs = [timed(b, gen) for _ in range(int(req.get("decode_repeats", 3)))]
        total, tokens = _median(runs)
        decode = b * (gen - 1) / (total - first) if total > first else None
        each = [round(b * (gen - 1) / (t - first), 1) if t > first else None for t, _ in runs]
        out["batches"][str(b)] = {"first_token_s": first, "total_s": total, "tokens": tokens, "decode_tok_s": decode,
                                  "decode_tok_s_runs": each}
    if req.get("sample_prompt"):
        sp = SamplingParams(temperature=0.0, max_tokens=int(req.get("sample_tokens", 32)), detokenize=False)
        ids = list(llm.generate([req["sample_prompt"]], sp, use_tqdm=False)[0].outputs[0].token_ids)
        out["sample_ids"] = ids
        try:
            out["sample"] = llm.get_tokenizer().decode(ids)
        except Exception:  # ids past the tokenizer's vocabulary (random-weight models): keep the ids only
            pass
    return out


def main():
    with open(sys.argv[1]) as f:
        req = json.load(f)
    try:
        result = measure(req)
    except Exception as e:  # reported to the parent as data; the traceback stays in the log
        traceback.print_exc()
        print("RESULT " + json.dumps({"error": f"{type(e).__name__}: {e}"[:1000]}), flush=True)
        sys.exit(1)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
