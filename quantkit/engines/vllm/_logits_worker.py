"""vLLM prompt-logprobs worker, run by :mod:`quantkit.engines.vllm.logits` with vLLM's own Python interpreter.

It imports only the standard library, numpy and vLLM (never quantkit), so vLLM may live in a separate
environment with its own torch. Written against the vLLM V1 offline API (``LLM.generate`` with
``TokensPrompt`` and ``SamplingParams(prompt_logprobs=k)``).

Protocol: ``python _logits_worker.py REQUEST.json``. The request names the model, ``max_model_len``, ``topk`` and
extra ``LLM`` keyword arguments. The worker loads the model, prints ``READY <json info>``, then reads lines from
stdin: each names a ``.npz`` of windows (``tokens`` concatenated, ``offsets``, ``score_from``, ``index``) and an
output folder. For each window it writes ``w<index>.npz`` (``target`` [n], ``ids`` [n, k], ``values`` [n, k] for
the scored positions) and prints ``WINDOW <index>``; after the last it prints ``DONE``. A line that is a JSON
object ``{"images": FILE, "out": DIR}`` scores image prompts instead: FILE lists ``tokens`` (the prompt with one image
placeholder, which vLLM's own processor expands, then the answer), ``image`` (a file) and ``answer`` (how many of
the last tokens to score); each writes ``i<index>.npz`` (the same arrays, for the answer's positions) and prints
``IMAGE <index>``, then ``DONE``. An empty line or end of input ends the worker. Protocol lines go to the original
stdout; everything else vLLM prints goes to stderr.

``DONE`` after windows carries a JSON object: ``generate_s``, the seconds spent inside ``llm.generate`` with
``prompt_logprobs`` (vLLM's own prompt-logprob throughput on these tokens), ``convert_s``, the seconds spent turning
its answers into arrays and files, and ``tokens``, the tokens run. A line ``{"prefill": FILE}`` (the same ``.npz``)
times ``llm.generate`` over those windows without ``prompt_logprobs`` and answers ``DONE {"generate_s": ...}``: what
the forward passes alone cost, the floor under prompt log-probabilities.

vLLM's answers are read as arrays: with ``SamplingParams(flat_logprobs=True)`` (vLLM 0.11.1 on) a request's prompt
log-probabilities come as one ``FlatLogprobs``, columns over every (position, entry): each scored position holds the
prompt token with its rank first, then the top-k in rank order, so the rows are gathered by index arithmetic over all
positions at once. An older vLLM's list of per-position dicts is read one position at a time.
"""

import json
import os
import sys
import time

# Run as a script, this folder is sys.path[0], where quantkit's own modules (kernels.py...) would shadow packages of
# the same name that vLLM and its dependencies import.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != os.path.dirname(os.path.abspath(__file__))]

# A window of exactly max_position_embeddings tokens needs one position more for the single sampled token, which
# is thrown away: only prompt positions are scored. vLLM refuses that extra position unless told it is intended.
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

BATCH = 64  # windows handed to vLLM at once (it schedules them together)


def _emit(stream, line):
    stream.write(line + "\n")
    stream.flush()


def _window_arrays(np, prompt_logprobs, tokens, score_from, k):
    """The scored rows of one window: actual-token log-prob, and top-k ids/log-probs in rank order."""
    if hasattr(prompt_logprobs, "start_indices"):
        rows = _flat_arrays(np, prompt_logprobs, tokens, score_from, k)
        if rows is not None:
            return rows
    n = len(tokens) - score_from
    target = np.empty(n, dtype=np.float32)
    ids = np.full((n, k), -1, dtype=np.int32)
    values = np.full((n, k), -np.inf, dtype=np.float32)
    for row, pos in enumerate(range(score_from, len(tokens))):
        entries = prompt_logprobs[pos]
        target[row] = entries[tokens[pos]].logprob
        ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)[:k]
        for j, (tid, lp) in enumerate(ranked):
            ids[row, j] = tid
            values[row, j] = lp.logprob
    return target, ids, values


def _flat_arrays(np, flat, tokens, score_from, k):
    """The same rows from a FlatLogprobs, for every position at once; None when a position does not hold the
    prompt token then exactly k ranked entries (then the per-position reading decides)."""
    stop = len(tokens)
    starts = np.asarray(flat.start_indices, dtype=np.int64)[score_from:stop]
    ends = np.asarray(flat.end_indices, dtype=np.int64)[score_from:stop]
    if len(starts) != stop - score_from or not np.all(ends - starts == k + 1):
        return None
    entry_ids = np.asarray(flat.token_ids, dtype=np.int64)
    entry_lps = np.asarray(flat.logprobs, dtype=np.float32)
    if not np.array_equal(entry_ids[starts], np.asarray(tokens[score_from:stop], dtype=np.int64)):
        return None
    ranked = starts[:, None] + 1 + np.arange(k)
    return entry_lps[starts], entry_ids[ranked].astype(np.int32), entry_lps[ranked]


def _params(SamplingParams, k):
    """Prompt log-probabilities only, flat where this vLLM can (see the module docstring)."""
    base = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k, "detokenize": False}
    try:
        return SamplingParams(**base, flat_logprobs=True)
    except TypeError:  # vLLM before 0.11.1 has no flat_logprobs
        return SamplingParams(**base)


def main():
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything vLLM prints to stdout lands on stderr, never in the protocol stream
    with open(sys.argv[1]) as f:
        req = json.load(f)
    import numpy as np
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    k = int(req["topk"])
    args = {"gpu_memory_utilization": 0.8, "enable_prefix_caching": False, "dtype": "auto", "seed": 0,
            **req.get("engine_args", {})}
    llm = LLM(model=req["model"], max_model_len=int(req["max_model_len"]), max_logprobs=k,
              trust_remote_code=False, **args)
    info = {"version": vllm.__version__}
    try:
        import torch

        info["device"] = torch.cuda.get_device_name(0)
    except Exception:  # the device name is informative only
        info["device"] = "cuda"
    _emit(proto, "READY " + json.dumps(info))
    params = _params(SamplingParams, k)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            break
        request = json.loads(line)
        if isinstance(request, dict) and "prefill" in request:
            _prefill(np, llm, SamplingParams, TokensPrompt, request["prefill"], proto)
        elif isinstance(request, dict):
            _images(np, llm, params, request, k, proto)
        else:
            _windows(np, llm, params, TokensPrompt, request, k, proto)


def _windows(np, llm, params, TokensPrompt, request, k, proto):
    """Score a file of windows, each written as it is ready; DONE carries the time vLLM itself took."""
    windows_path, out_dir = request
    data = np.load(windows_path)
    offsets, score_from, flat, index = data["offsets"], data["score_from"], data["tokens"], data["index"]
    count = len(score_from)
    generate_s = convert_s = 0.0
    for start in range(0, count, BATCH):
        chunk = range(start, min(count, start + BATCH))
        prompts = [TokensPrompt(prompt_token_ids=flat[offsets[i]:offsets[i + 1]].tolist()) for i in chunk]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        t1 = time.perf_counter()
        generate_s += t1 - t0
        for i, out in zip(chunk, outputs):
            tokens = flat[offsets[i]:offsets[i + 1]].tolist()
            target, ids, values = _window_arrays(np, out.prompt_logprobs, tokens, int(score_from[i]), k)
            dest = os.path.join(out_dir, f"w{int(index[i])}.npz")
            np.savez(dest + ".tmp.npz", target=target, ids=ids, values=values)
            os.replace(dest + ".tmp.npz", dest)
            _emit(proto, f"WINDOW {int(index[i])}")
        convert_s += time.perf_counter() - t1
    _emit(proto, "DONE " + json.dumps({"generate_s": generate_s, "convert_s": convert_s, "tokens": int(offsets[-1])}))


def _prefill(np, llm, SamplingParams, TokensPrompt, windows_path, proto):
    """Time the same windows' forward passes without prompt log-probabilities (one token generated, greedy)."""
    data = np.load(windows_path)
    offsets, flat = data["offsets"], data["tokens"]
    prompts = [TokensPrompt(prompt_token_ids=flat[offsets[i]:offsets[i + 1]].tolist()) for i in range(len(offsets) - 1)]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    t0 = time.perf_counter()
    for start in range(0, len(prompts), BATCH):
        llm.generate(prompts[start:start + BATCH], params, use_tqdm=False)
    _emit(proto, "DONE " + json.dumps({"generate_s": time.perf_counter() - t0, "tokens": int(offsets[-1])}))


def _images(np, llm, params, request, k, proto):
    """Image prompts: each prompt's answer positions, scored with the image in vLLM's multimodal input."""
    from PIL import Image
    from vllm.inputs import TokensPrompt

    with open(request["images"]) as f:
        prompts = json.load(f)
    for p in prompts:
        with Image.open(p["image"]) as img:
            image = img.convert("RGB")
        out = llm.generate([TokensPrompt(prompt_token_ids=p["tokens"], multi_modal_data={"image": image})], params,
                           use_tqdm=False)[0]
        tokens = list(out.prompt_token_ids)  # after vLLM expanded the image placeholder
        if tokens[-p["answer"]:] != p["tokens"][-p["answer"]:]:
            raise RuntimeError("vLLM's expanded prompt does not end with the answer tokens it was given")
        target, ids, values = _window_arrays(np, out.prompt_logprobs, tokens, len(tokens) - p["answer"], k)
        dest = os.path.join(request["out"], "i%d.npz" % p["index"])
        np.savez(dest + ".tmp.npz", target=target, ids=ids, values=values)
        os.replace(dest + ".tmp.npz", dest)
        _emit(proto, "IMAGE %d" % p["index"])
    _emit(proto, "DONE")


if __name__ == "__main__":
    main()
