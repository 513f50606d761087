#!/usr/bin/env bash
# Issue 28 on one lent H200: SGLang 0.5.17 beside vLLM 0.26.0 on the reference model's artifacts (models/quantkit-tiny,
# which travels with the tree): every compressed-tensors format, the legacy AutoAWQ/GPTQ layouts, ModelOpt FP8 and
# W4A8 (which SGLang's load table refuses), each scored by `quantkit eval --engine sglang` and `--engine vllm` on the
# same tokens and served by `quantkit smoke --engine sglang`. One background job, started by the first call, while
# later calls bring the parts.
#
#   here first: PART_MIB=25 bash ../shared/device/vllm/build.sh        # .vw00 ... .vw13 (vLLM's set)
#               bash scripts/sglang_wheels/build.sh                    # .sw00 .sw01 (FA3=1: also .sf00 ... .sf05)
#               .whl-llmc as in ../shared/device/llmcompressor/README.md (the job quantizes on the GPU)
#               bash bench/h200_sglang.sh pack-modelopt                 # optional, .smo: the ModelOpt FP8 export of
#                                                                       # the reference model, made here (.venv-trt)
#   there, every call:  bash bench/h200_sglang.sh take                  # moves what it carried to /tmp
#               bash bench/h200_sglang.sh start [MINUTES]               # once: the job; nothing starts after MINUTES
#               bash bench/h200_sglang.sh vllm                          # in the call that brings the last .vw part
#               bash bench/h200_sglang.sh sglang                        # once vLLM is assembled and every .sw (and
#                                                                       # .sf) part is there
#               bash bench/h200_sglang.sh status | wait SECONDS "$OUT" | collect "$OUT"
#
# The job (from a snapshot, /tmp/qk-sgl-snap): the artifacts, quantized on the GPU while parts arrive; once SGLang is
# assembled, imports one by one (sgl_kernel and its GPU kernel, flashinfer, SGLang's server modules) and a first
# server on the bf16 model (it compiles SGLang's JIT kernels): any failure is recorded with its error and ends the
# SGLang branch; then per artifact eval, then smoke (those SMOKE names) or doctor in SGLang,
# beside one `quantkit eval --engine vllm` of them all (VLLM=0: none), the tokens fixed by the protocol; a server
# start costs 30-110 s (the first run: imports 63 s, first SGLang server 102 s, a vLLM eval 107 s). Each step writes
# its JSON (or its error) under results/ as soon as it
# ends. Without FA3's parts SGLang runs with --attention-backend triton (recorded). Where bench/h200_real.sh built
# SmolLM2-135M in the same lease, its RTN W4A16 is served with --skip-doctor: doctor predicts SGLang's Marlin kernel
# has no tile for its 576-wide layers, and SGLang's own answer is recorded beside. The series runs SGLANG_LANES (3)
# SGLang servers at a time, each with a small fixed KV pool so they and vLLM's share the GPU. SPEED=1 adds decode
# tok/s of the 8B shape (bf16, random weights; its source is written while the parts arrive) at batch 1 and 16 in
# both engines' servers with CUDA graphs on (bench/engine_speed.py), after the series and the VLM job, in the last
# SPEED_RESERVE seconds, which the series leaves to it.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
. "$REPO/bench/device.sh"
SNAP=/tmp/qk-sgl-snap
LOGS=/tmp/qk-sgl-logs
WORK=/tmp/qk-sgl-work
SITE_SGL=/tmp/site-sgl
MODELOPT=/tmp/qk-sgl-modelopt  # the carried ModelOpt FP8 export (.smo)
TINY=models/quantkit-tiny
SMOLLM2=/tmp/qk-real/SmolLM2-135M-Instruct
EVAL_ARGS=(--baseline "$TINY" --dataset heldout --max-tokens 32768 --ctx 2048 --json)
# The artifacts in the order they are served (ARTS_LIST: another list), each eval and each smoke one server start;
# SMOKE names those also smoke-tested (all: every one; smoke runs doctor first, the others get doctor alone), VLLM=0
# leaves vLLM's side out.
read -r -a ARTS <<< "${ARTS_LIST:-rtn-w4g128 fp8-dynamic int8-sq awq-legacy modelopt-fp8 gptq-legacy awq-w4g128 \
gptq-w4g128 fp8-static fp8-block gptq-w8g128 w4a8}"
SMOKE="${SMOKE:-awq-legacy modelopt-fp8 gptq-legacy w4a8}"  # rtn-w4g128, fp8-dynamic: passed in the second run
# SKIP_DOCTOR names smoked artifacts served without doctor's verdict, for SGLang's own answer to what doctor refuses
SPEED_RESERVE=420  # seconds of the job kept for SPEED=1 (two 8B server starts with CUDA graphs, and the figures)

pack() {  # here: the reference model's ModelOpt FP8 export (build-trt --checkpoint-only) into .smo
  local out; out=$(mktemp -d)/modelopt-fp8
  cd "$REPO" || exit 1
  "$REPO/.venv/bin/python" -m quantkit build-trt "$REPO/recipes/trt-fp8.yaml" --checkpoint-only -o "$out" --quiet \
    --python "$REPO/.venv-trt/bin/python" || exit 1
  rm -rf "$REPO/.smo" && mkdir -p "$REPO/.smo" && cp -r "$out/hf" "$REPO/.smo/hf"
  grep -qxF '/.smo/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.smo/' >> "$REPO/.git/info/exclude"
  du -sh "$REPO/.smo"
}

take() {  # every call: what it carried leaves the tree before the next call lays the tree anew
  [ -d "$REPO/.whl-llmc" ] && install_llmc && echo "llm-compressor installed"
  if [ -d "$REPO/.smo" ]; then rm -rf "$MODELOPT" && cp -r "$REPO/.smo" "$MODELOPT" && echo "ModelOpt export taken"; fi
  if ls "$REPO"/.sw[0-9]*/p[0-9]* > /dev/null 2>&1; then
    mkdir -p /tmp/swp && mv "$REPO"/.sw[0-9]*/p[0-9]* /tmp/swp/ && echo "sglang parts: $(ls /tmp/swp | tr '\n' ' ')"
  fi
  if ls "$REPO"/.sf[0-9]*/p[0-9]* > /dev/null 2>&1; then
    mkdir -p /tmp/sfp && mv "$REPO"/.sf[0-9]*/p[0-9]* /tmp/sfp/ && echo "FA3 parts: $(ls /tmp/sfp | tr '\n' ' ')"
  fi
  take_parts
}

assemble_sglang() {  # every .sw part there (and .sf, for FA3), vLLM assembled: SGLang's set into /tmp/site-sgl
  [ -f /tmp/site/.assembled ] || { echo "error: assemble vLLM first (bash $0 vllm)" >&2; return 1; }
  rm -rf /tmp/sw /tmp/sf && mkdir -p /tmp/sw /tmp/sf
  cat /tmp/swp/p* | tar xf - -C /tmp/sw || { echo "error: the .sw parts do not make a whole archive" >&2; return 1; }
  if ls /tmp/sfp/p* > /dev/null 2>&1; then
    cat /tmp/sfp/p* | tar xf - -C /tmp/sf || { echo "error: the .sf parts do not make a whole archive" >&2; return 1; }
  fi
  SITE="$SITE_SGL" FA3_DIR=/tmp/sf/fa3 bash /tmp/sw/set/assemble.sh 2>&1 | tee /tmp/qk-sgl-assemble.log
  [ -f "$SITE_SGL/.assembled" ] && echo "SGLang assembled"
}

sglang_python() {  # bench/.sglang-python: SGLang's folder alone on the path (vLLM's set linked into it, vLLM left out)
  printf '#!/bin/sh\nexport PYTHONPATH=%s HF_HUB_OFFLINE=1\nexec python3 "$@"\n' \
    "$SITE_SGL" > bench/.sglang-python
  chmod +x bench/.sglang-python
}

step() {  # step NAME CMD...: run, its stdout to results/NAME.json (or .txt), stderr to logs/NAME.err, logged
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$LOGS/results/$name.json" 2> "$LOGS/steps/$name.err"
  local rc=$?
  local why=""
  [ $rc -ne 0 ] && why=": $(grep -v '^\s*$' "$LOGS/steps/$name.err" | tail -n 1 | cut -c1-300)"
  log "$name: exit $rc ($(( SECONDS - t0 )) s)$why"
  return $rc
}

make_artifacts() {  # the reference model's artifacts, four at a time; each verb's JSON is its record
  local specs=("rtn-w4g128 rtn" "awq-w4g128 awq" "gptq-w4g128 gptq" "gptq-w8g128 gptq --bits 8" "fp8-static fp8"
               "fp8-dynamic fp8 --scheme dynamic" "fp8-block fp8 --scheme block" "int8-sq int8"
               "awq-legacy awq --format autoawq" "gptq-legacy gptq --format gptq" "w4a8 w4a8 --weights rtn")
  local s n=0
  for s in "${specs[@]}"; do
    set -- $s
    case " ${ARTS[*]} " in *" $1 "*) ;; *) continue ;; esac  # only what is served
    step "make-$1" python3 -m quantkit "$2" "$TINY" "$WORK/$1" "${@:3}" --force --json &
    n=$((n + 1)); [ $((n % 4)) -eq 0 ] && wait
  done
  wait
  if [ -d "$MODELOPT/hf" ]; then ln -sfn "$MODELOPT" "$WORK/modelopt-fp8"; log "modelopt-fp8: the carried export"; fi
  if [ -f "$SMOLLM2/config.json" ]; then  # built by bench/h200_real.sh in the same lease
    step make-smollm2-rtn python3 -m quantkit rtn "$SMOLLM2" "$WORK/smollm2-rtn" --force --json
  fi
}

target() {  # target ROOT NAME: the folder an engine loads (the legacy layouts' and ModelOpt's subfolders)
  case "$2" in
    awq-legacy) echo "$1/$2/autoawq" ;; gptq-legacy) echo "$1/$2/gptq" ;; modelopt-fp8) echo "$1/$2/hf" ;;
    *) echo "$1/$2" ;;
  esac
}

imports() {  # each piece alone, so the first that fails is the one named; exit 1 on any failure
  bench/.sglang-python - <<'EOF'
import importlib.metadata as md, json, sys, time, traceback
out, ok = {}, True
def attempt(name, fn):
    global ok
    t0 = time.time()
    try:
        out[name] = {"ok": True, "value": fn(), "s": round(time.time() - t0, 1)}
    except BaseException as e:
        ok = False
        out[name] = {"ok": False, "error": "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:],
                     "traceback": traceback.format_exc()[-4000:]}
def versions():
    return {d: md.version(d) for d in ("sglang", "sglang-kernel", "flashinfer-python", "transformers", "tokenizers",
                                       "apache-tvm-ffi", "compressed-tensors", "xgrammar", "torch", "triton")}
def kernel():
    import torch, sgl_kernel
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    y = sgl_kernel.rmsnorm(x, w, 1e-6); torch.cuda.synchronize()
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return {"rmsnorm_max_err": float((y.float() - ref).abs().max()), "device": torch.cuda.get_device_name(0)}
def fa3():
    from sgl_kernel import flash_attn
    return flash_attn.is_fa3_supported()
attempt("versions", versions)
attempt("sgl_kernel", kernel)
attempt("flashinfer", lambda: __import__("flashinfer").__version__)
attempt("sglang.srt.entrypoints.http_server", lambda: bool(__import__("sglang.srt.entrypoints.http_server")))
attempt("fa3", fa3)
out["fa3"]["required"] = False
ok = all(v["ok"] for k, v in out.items() if k != "fa3")
print(json.dumps(out, indent=1))
sys.exit(0 if ok else 1)
EOF
}

# SGLang sizes its KV pool as what is free after its weights load minus (1 - mem-fraction-static) of what was free
# before (mem_cache/kv_cache_configurator.py), so with the default 0.4 one server takes most of the GPU: the first
# server and the speed runs run alone that way; the series' servers get 0.9 and a pool capped by --max-total-tokens,
# so three of them fit beside one vLLM process at 0.3 (what vLLM asks is checked against what is free).
SMOKE_ARGS=(--engine sglang --python bench/.sglang-python --timeout 900 --json
            --chat-prompt "What is the capital of France?")

sglang_series() {  # sglang_series DEADLINE ARTIFACT...: per artifact doctor, eval, smoke (SGLang), one at a time
  local deadline=$1 a t; shift
  for a in "$@"; do
    [ "$(left "$deadline")" -le 60 ] && { log "sglang: no time left for $a"; continue; }
    t=$(target "$WORK" "$a"); [ -e "$t" ] || { log "sglang: $a was not made"; continue; }
    step "eval-$a-sglang" python3 -m quantkit eval "$t" --engine sglang --python bench/.sglang-python \
      --report-dir "$WORK/report-$a-sglang" "${EVAL_ARGS[@]}"
    case " $SMOKE " in
      *" $a "*|" all ") local skip=(); case " ${SKIP_DOCTOR:-} " in *" $a "*) skip=(--skip-doctor) ;; esac
        step "smoke-$a-sglang" python3 -m quantkit smoke "$t" --log-dir "$LOGS/servers" \
        "${SMOKE_ARGS[@]}" "${SERIES_ARGS[@]}" "${skip[@]}" ;;
      *) [ "${DOCTOR:-1}" = 0 ] || step "doctor-$a-sglang" python3 -m quantkit doctor "$t" --engine sglang --python bench/.sglang-python --json ;;
    esac
  done
}

vllm_series() {  # vllm_series DEADLINE ARTIFACT...: VLLM_LANES (3) `quantkit eval --engine vllm` processes side by
  # side, each scoring the baseline and its share of the artifacts, on copies of them (each eval re-seals its
  # artifact's manifest, as the SGLang series does its own); one process loads its artifacts one after another
  local deadline=$1 a t lanes="${VLLM_LANES:-3}" l i; shift
  local found=(); for a in "$@"; do t=$(target "$WORK-vllm" "$a"); [ -e "$t" ] && found+=("$t"); done
  [ "$(left "$deadline")" -le 120 ] && { log "vllm: no time left"; return; }
  for ((l = 0; l < lanes; l++)); do
    local targets=(); for ((i = l; i < ${#found[@]}; i += lanes)); do targets+=("${found[$i]}"); done
    [ ${#targets[@]} -eq 0 ] && continue
    # a fixed KV cache: vLLM then skips its memory profiling, whose check ("Error in memory profiling ... other
    # processes sharing the same container release GPU memory") an SGLang server stopping beside it would trip
    step "eval-vllm-$l" env QUANTKIT_VLLM_ARGS='{"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 4294967296, "enforce_eager": true}' \
      python3 -m quantkit eval "${targets[@]}" \
      --engine vllm --python bench/.vllm-python --report-dir "$WORK/report-vllm-$l" "${EVAL_ARGS[@]}" &
  done
  wait
}

prepare_8b() {  # SPEED=1, in the background from the job's start: the 8B shape's bf16 source (random weights)
  python3 bench/quantize_cost.py --shape 8b --samples 1 --seq-len 16 --prepare > "$LOGS/steps/prepare-8b.log" 2>&1
  log "8b shape prepared: exit $?"
}

speed() {  # SPEED=1: decode tok/s of the 8B shape at batch 1 and 16 in each engine's server with CUDA graphs on
  # (bench/engine_speed.py), after the series and the VLM job (nothing else on the GPU), in the time kept for it
  wait "$PREPARE_PID"
  local src; src=$(ls -d /tmp/quantkit-bench-qcost/src-8b 2>/dev/null)
  [ -n "$src" ] || { log "speed: no 8B source"; return; }
  local until=$(( $(date +%s) + 240 ))
  until grep -q "gpu_cases exited\|no case run" /tmp/qk-vlm-logs/job.log 2>/dev/null || [ ! -f /tmp/qk-vlm-logs/job.log ] \
    || [ "$(date +%s)" -ge "$until" ]; do sleep 5; done
  grep -q "gpu_cases exited\|no case run" /tmp/qk-vlm-logs/job.log 2>/dev/null || [ ! -f /tmp/qk-vlm-logs/job.log ] \
    || log "speed: the VLM job is still running beside it"
  step "speed-8b-sglang" python3 bench/engine_speed.py "$src" --engine sglang --python bench/.sglang-python \
    --log "$LOGS/servers/speed-8b-sglang.log" "${ATTN_ARGS[@]}"
  step "speed-8b-vllm" python3 bench/engine_speed.py "$src" --engine vllm --python bench/.vllm-python \
    --gpu-memory-utilization 0.5 --log "$LOGS/servers/speed-8b-vllm.log"
}

job() {  # $1 = epoch second after which no step starts
  local deadline=$1
  enter_snapshot
  sglang_python
  mkdir -p "$LOGS/steps" "$LOGS/servers" "$WORK"
  log "1: the reference model's artifacts (GPU), while parts arrive"
  PREPARE_PID=
  if [ "${SPEED:-0}" = 1 ]; then prepare_8b & PREPARE_PID=$!; fi
  make_artifacts
  rm -rf "$WORK-vllm" && cp -r "$WORK" "$WORK-vllm"
  log "artifacts: $(ls "$WORK" | tr '\n' ' ')"
  until [ -f "$SITE_SGL/.assembled" ] || [ "$(left "$deadline")" -le 240 ]; do sleep 5; done
  cp /tmp/qk-sgl-assemble.log "$LOGS/steps/" 2>/dev/null
  local arts=("${ARTS[@]}")
  if [ ! -f "$SITE_SGL/.assembled" ]; then
    log "SGLang not assembled in time: only vLLM's series"
    [ -f /tmp/site/.assembled ] && vllm_series "$deadline" "${arts[@]}"
    log "done"; return
  fi
  ATTN_ARGS=() ATTN_RAW=()
  if [ ! -f "$SITE_SGL/sgl_kernel/flash_ops.abi3.so" ]; then
    ATTN_RAW=(--attention-backend triton)
    ATTN_ARGS=(--server-arg=--attention-backend --server-arg=triton)
    export QUANTKIT_SGLANG_ARGS='["--attention-backend", "triton"]'
    log "no FA3 library: SGLang runs with --attention-backend triton"
  fi
  if [ "${GATE:-1}" = 0 ]; then  # a short lease, SGLang already proven: straight to the series
    log "2: skipped (GATE=0)"
  else
  log "2: imports, then SGLang's first server (bf16; compiles its JIT kernels)"
  if ! step imports imports; then
    log "SGLang does not import: its branch ends here (results/imports.json has the error)"
    vllm_series "$deadline" "${arts[@]}"; log "done"; return
  fi
  step doctor-env-sglang python3 -m quantkit doctor --engine sglang --python bench/.sglang-python --json
  if ! step "smoke-bf16-sglang" python3 -m quantkit smoke "$TINY" --log-dir "$LOGS/servers" "${SMOKE_ARGS[@]}" \
      "${ATTN_ARGS[@]}"; then
    log "SGLang's first server failed: its branch ends here (results/smoke-bf16-sglang.json, servers/)"
    vllm_series "$deadline" "${arts[@]}"; log "done"; return
  fi
  if [ -d "$WORK/smollm2-rtn" ] && [ "$(left "$deadline")" -gt 120 ]; then
    # doctor refuses SmolLM2's W4A16 in SGLang (no Marlin tile fits its 576-wide layers): SGLang's own answer
    step doctor-smollm2-rtn-sglang python3 -m quantkit doctor "$WORK/smollm2-rtn" --engine sglang \
      --python bench/.sglang-python --json
    step smoke-smollm2-rtn-sglang python3 -m quantkit smoke "$WORK/smollm2-rtn" --skip-doctor --log-dir \
      "$LOGS/servers" "${SMOKE_ARGS[@]}" "${ATTN_ARGS[@]}"
  fi
  fi
  local reserve=0 lanes="${SGLANG_LANES:-3}" i l
  [ "${SPEED:-0}" = 1 ] && reserve=$SPEED_RESERVE
  log "3: per artifact: eval, then smoke or doctor (SGLang, $lanes servers at a time) beside eval (vLLM)"
  # the lanes' servers share the GPU: a small fixed KV pool each (--max-total-tokens), the rest left to the others
  local share=(--mem-fraction-static 0.9 --max-total-tokens 65536)
  export QUANTKIT_SGLANG_ARGS; QUANTKIT_SGLANG_ARGS=$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \
    "${ATTN_RAW[@]}" "${share[@]}")
  SERIES_ARGS=("${ATTN_ARGS[@]}"); for i in "${share[@]}"; do SERIES_ARGS+=("--server-arg=$i"); done
  [ "${VLLM:-1}" = 1 ] && vllm_series "$(( deadline - reserve ))" "${arts[@]}" &
  for ((l = 0; l < lanes; l++)); do
    local lane=(); for ((i = l; i < ${#arts[@]}; i += lanes)); do lane+=("${arts[$i]}"); done
    sglang_series "$(( deadline - reserve ))" "${lane[@]}" &
  done
  wait
  if [ "${SPEED:-0}" = 1 ] && [ "$(left "$deadline")" -gt 60 ]; then log "4: the 8B shape's decode"; speed; fi
  log "done"
}

collect() {  # collect DEST: the summary, the job's log, its results and logs, the servers' logs so far (the eval
  # servers' logs, which quantkit keeps only when they failed), into DEST
  # (a function, not "$0 collect": a call runs this script through bash, and its mode need not be executable; the
  # 2026-12-02 run's wait verb failed that way and brought nothing back)
  mkdir -p "$1" "$LOGS/servers"
  cp /tmp/quantkit-sglang-*.log /tmp/quantkit-vllm-*.log "$LOGS/servers/" 2>/dev/null
  summary > "$LOGS/steps/summary.log" 2>&1
  cp "$LOGS/job.log" "$LOGS/results/sglang_vs_vllm.md" "$1/" 2>/dev/null
  collect_results "$1"
}

summary() {  # results/sglang_vs_vllm.{json,md}: the two engines' figures per artifact, from the step files
  python3 - "$LOGS/results" <<'EOF'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
def load(name):
    p = res / f"{name}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
rows = []
for make in sorted(res.glob("make-*.json")):
    a = make.stem[len("make-"):]
    row = {"artifact": a}
    batch = [r for f in sorted(res.glob("eval-vllm-*.json")) for r in (load(f.stem) or {}).get("results", [])
             if Path(r.get("path", "")).parts[3:4] == (a,)]  # /tmp/qk-sgl-work-vllm/ARTIFACT[/subfolder]
    for eng in ("sglang", "vllm"):
        ev = load(f"eval-{a}-{eng}")
        r = (ev or {}).get("results", [{}])[0] if ev else (batch[0] if eng == "vllm" and batch else {})
        row[eng] = {k: r.get(k) for k in ("ppl", "kld", "top1", "ppl_ratio")} if r else None
        if eng == "sglang" and r:
            row["sglang_engine"] = r.get("engine")
    sm = load(f"smoke-{a}-sglang")
    run = ((sm or {}).get("runs") or [{}])[0]
    row["smoke"] = {k: run.get(k) for k in ("status", "error", "decode_tokens_per_s", "healthy_after_s", "facts")}
    checks = (load(f"doctor-{a}-sglang") or {}).get("checks") or ((sm or {}).get("doctor") or {}).get("checks") or []
    row["doctor"] = [c for c in checks if c.get("status") != "ok"]
    if row["sglang"] and row["vllm"]:
        s, v = row["sglang"], row["vllm"]
        row["diff"] = {k: (abs(s[k] - v[k]) if s.get(k) is not None and v.get(k) is not None else None)
                       for k in ("ppl_ratio", "kld", "top1")}
    rows.append(row)
(res / "sglang_vs_vllm.json").write_text(json.dumps(rows, indent=1))
f = lambda x, d=4: "-" if x is None else f"{x:.{d}f}"
lines = ["| artifact | SGLang ppl ratio / KLD / top-1 | vLLM ppl ratio / KLD / top-1 | SGLang smoke | notes |",
         "| --- | --- | --- | --- | --- |"]
for r in rows:
    s, v, sm = r["sglang"] or {}, r["vllm"] or {}, r["smoke"]
    note = "; ".join(c["message"][:160] for c in r["doctor"] if c.get("status") == "fail") or \
        (sm.get("error") or "")[:160]
    lines.append(f"| {r['artifact']} | {f(s.get('ppl_ratio'))} / {f(s.get('kld'))} / {f(s.get('top1'), 3)} | "
                 f"{f(v.get('ppl_ratio'))} / {f(v.get('kld'))} / {f(v.get('top1'), 3)} | {sm.get('status') or '-'} | "
                 f"{note.replace('|', '/')} |")
speed = {eng: load(f"speed-8b-{eng}") for eng in ("sglang", "vllm")}
if any(speed.values()):
    lines += ["", "| 8B shape, bf16 (CUDA graphs) | TTFT s | batch 1 tok/s | batch 16 tok/s | healthy after s |",
              "| --- | --- | --- | --- | --- |"]
    for eng, sp in speed.items():
        b = (sp or {}).get("batches") or {}
        lines.append(f"| {eng} | {f((sp or {}).get('ttft_s'), 3)} | "
                     f"{f((b.get('1') or {}).get('decode_tokens_per_s'), 1)} | "
                     f"{f((b.get('16') or {}).get('decode_tokens_per_s'), 1)} | {f((sp or {}).get('healthy_after_s'), 0)} |")
(res / "sglang_vs_vllm.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}

case "${1:-}" in
  pack-modelopt) pack ;;
  take) take ;;
  start) start_job h200_sglang.sh job "${2:-24}" ;;
  job) job "$2" ;;
  vllm) assemble_vllm ;;
  sglang) assemble_sglang ;;
  status)
    cat "$LOGS/job.log" 2>/dev/null
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  wait)  # wait SECONDS DEST: until the job logs "done" (or SECONDS pass), then collect into DEST
    end=$(( $(date +%s) + $2 ))
    until grep -q "] done$" "$LOGS/job.log" 2>/dev/null || [ "$(date +%s)" -ge "$end" ]; do sleep 5; done
    collect "$3" ;;
  collect) collect "$2" ;;
  *) sed -n '2,30p' "$0"; exit 2 ;;
esac
