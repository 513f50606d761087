#!/usr/bin/env bash
# Issue 16 on one lent H200: kernel-aware serving, W4A8 and quantkit's own overhead on the 8B shape, one background
# job started by the first device call while later calls bring vLLM's wheel parts.
#
#   here first: PART_MIB=25 bash ../shared/device/vllm/build.sh (26 at most: part + the 34 MiB tracked tree stay
#   under 60 MiB), and .whl-llmc as in bench/h200_moe_plan.md
#   bash bench/h200_hopper.sh llmc               # install .whl-llmc into /tmp/site-llmc (first call)
#   bash bench/h200_hopper.sh start [MINUTES]    # start the job; nothing starts after MINUTES (default 25)
#   bash bench/h200_hopper.sh part               # move the carried .vw*/p* part to /tmp (one call each)
#   bash bench/h200_hopper.sh vllm               # assemble vLLM into /tmp/site once every part is there
#   bash bench/h200_hopper.sh status | collect "$OUT"
#
# The job, from a snapshot of the repository (/tmp/qk-hop; each device call re-sends the working tree):
#   A  untimed: the 8B shape and its 32 x 2048 calibration tokens (bench/quantize_cost.py --prepare), then side by
#      side the two artifacts only served here: quantkit gptq (W4A16) and quantkit w4a8 (W4AFP8), calibrated on the
#      shipped set (random weights: what is measured is their speed, not their quality).
#   B  timed, alone: bench/quantize_cost.py, FP8 static through llm-compressor directly and through quantkit, two
#      runs each (order alternated), quantkit's artifact kept for serving.
#   C  timed, alone, once vLLM is assembled: bench/serve_speed.py of bf16, W4A8 and FP8 static at batch 1, 16 and
#      64; then `quantkit tune` of the W4A16 artifact (every linear kernel vLLM 0.26 can use for it on Hopper, same
#      batches), which records the table and the fastest `vllm serve` command in its manifest.
#   D  timed, alone, if time is left: AWQ through both tools (one run each), then INT8 SmoothQuant.
#
#   bash bench/h200_hopper.sh start-cost [MINUTES]   # the quantization-cost job alone: no vLLM, no part calls
#   E  untimed: the shape and, beside it, the AWQ GPU tests (AWQ's cached inputs offloaded to the host give the
#      same weights bit for bit as kept on the GPU). Timed, alone: FP8 static through both tools, two runs each
#      (quantkit sealing its output while it is written); AWQ through both, once; then (WIDE=1) the 70B width with 4
#      and 8 of its 80 layers, GPTQ and AWQ through quantkit, and bench/project.py's 70B and 405B projection; then,
#      as time allows, INT8 SmoothQuant and GPTQ through both tools, once each.
#
#   bash bench/h200_hopper.sh start-last [MINUTES]   # what issue 25 left: `llmc` and `start-last` in the first call,
#      carrying .whl-llmc alone (with a 25 MiB part beside the tree it passes 64 MiB), then part calls: .tw first
#      (ModelOpt), then .vw (vLLM); the 2026-12-04 lease (bench/results/h200/8b/README.md, the fourth lease).
#   I  untimed, side by side: the shape, quantkit's FP8 static artifact of it, and build-trt FP8 (ModelOpt) once
#      ModelOpt is there; J timed, alone, once vLLM is assembled too: GPTQ and INT8 SmoothQuant through both tools,
#      once each; L timed, alone: serve_speed of both FP8 exports, then the log says "timed runs done"
#      (bench/h200_real.sh's job waits for it: WAIT_DONE and WAIT_MARK); K untimed, beside that job's cases: both
#      exports scored in vLLM against the bf16 shape (QUANTKIT_VLLM_ARGS gives it 40% of the GPU).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
. "$REPO/bench/device.sh"
SNAP=/tmp/qk-hop
LOGS=/tmp/qk-hop-logs
WORK=/tmp/quantkit-bench-qcost
SAMPLES="${SAMPLES:-32}"
SEQ_LEN="${SEQ_LEN:-2048}"
SHAPE="${SHAPE:-8b}"  # start-cost's shape (tiny: a dry run of the script on a CPU)
WIDE="${WIDE:-1}"  # start-cost: also the 70B width with 4 and 8 layers (bench/project.py), about 10 minutes
BATCHES=1,16,64

cost() {  # cost NAME METHODS TOOLS REPEAT [--keep quantkit] [--append]: one quantize_cost run into results/NAME
  python3 bench/quantize_cost.py --shape "$SHAPE" --samples "$SAMPLES" --seq-len "$SEQ_LEN" --methods "$2" --tools "$3" \
    --repeat "$4" --name "$1" --results-dir "$LOGS/results" "${@:5}" >> "$LOGS/quantize.log" 2>&1
  log "quantize_cost $2 exited $?"
}

job() {  # $1 = epoch second after which no step starts
  local deadline=$1
  enter_snapshot

  log "A: the 8B shape ($SAMPLES x $SEQ_LEN tokens), then the W4A16 and W4A8 artifacts to serve"
  python3 bench/quantize_cost.py --shape 8b --samples "$SAMPLES" --seq-len "$SEQ_LEN" --prepare > "$LOGS/prepare.log" 2>&1
  log "prepare exited $?"
  python3 -m quantkit gptq "$WORK/src-8b" "$WORK/serve-gptq" --samples 32 --seq-len 512 --force --json \
    > "$LOGS/results/make_gptq.json" 2> "$LOGS/make_gptq.err" &
  python3 -m quantkit w4a8 "$WORK/src-8b" "$WORK/serve-w4a8" --samples 32 --seq-len 512 --force --json \
    > "$LOGS/results/make_w4a8.json" 2> "$LOGS/make_w4a8.err" &
  wait
  log "gptq and w4a8 made: $(ls "$WORK" | tr '\n' ' ')"

  log "B: FP8 static, both tools, two runs each (timed, alone)"
  cost quantize_cost_8b fp8-static llm-compressor,quantkit 2 --keep quantkit

  until [ -f /tmp/site/.assembled ] || [ "$(left "$deadline")" -le 300 ]; do sleep 5; done
  if [ -f /tmp/site/.assembled ] && [ "$(left "$deadline")" -gt 120 ]; then
    log "C: serve_speed bf16, W4A8, FP8 static at $BATCHES (timed, alone)"
    timeout $(( $(left "$deadline") + 60 )) python3 bench/serve_speed.py "$WORK/src-8b" "$WORK/serve-w4a8" \
      "$WORK/out-quantkit-fp8-static" --batches "$BATCHES" --python "$SNAP/bench/.vllm-python" \
      --name serve_speed_8b --results-dir "$LOGS/results" --logs "$LOGS/serve" >> "$LOGS/serve.log" 2>&1
    log "serve_speed exited $?"
    if [ "$(left "$deadline")" -gt 120 ]; then
      log "C: quantkit tune of the W4A16 artifact"
      python3 -m quantkit tune "$WORK/serve-gptq" --python "$SNAP/bench/.vllm-python" --batch 1 --batch 16 \
        --batch 64 --budget "$(( $(left "$deadline") + 60 ))" --json > "$LOGS/results/tune_gptq_8b.json" \
        2> "$LOGS/tune.err"
      log "tune exited $?"
    fi
  else
    log "vLLM not assembled in time or no time left: serving not run"
  fi

  if [ "$(left "$deadline")" -gt 420 ]; then
    log "D: AWQ, both tools (timed, alone)"
    cost quantize_cost_8b awq llm-compressor,quantkit 1 --append
  fi
  if [ "$(left "$deadline")" -gt 300 ]; then
    log "D: INT8 SmoothQuant, both tools (timed, alone)"
    cost quantize_cost_8b int8-sq llm-compressor,quantkit 1 --append
  fi
  log "done"
}

cost_job() {  # $1 = epoch second after which no step starts. Quantization cost only: no vLLM, so no part calls.
  # COST_PLAN: the timed runs in order, METHOD:REPEATS each, both tools, each started only with 300 s left;
  # WAIT_DONE=LOG: the timed runs wait until that job's log says "done" (another job sharing the lease, e.g.
  # bench/h200_sglang.sh's), so they still run alone
  local deadline=$1 entry m r
  enter_snapshot
  python3 bench/quantize_cost.py --shape "$SHAPE" --samples "$SAMPLES" --seq-len "$SEQ_LEN" --prepare \
    > "$LOGS/prepare.log" 2>&1 &
  python3 -m pytest -q -p no:cacheprovider tests/test_compressed.py -k "awq_on_gpu or awq_offload" \
    > "$LOGS/results/pytest_awq_gpu.log" 2>&1 &
  wait
  log "prepare $SHAPE and the AWQ GPU tests (offloaded = on-GPU weights): $(tail -n 1 "$LOGS/results/pytest_awq_gpu.log")"
  if [ -n "${WAIT_DONE:-}" ]; then
    wait_log "$WAIT_DONE" '] done$' "$deadline" 300
    log "E: $WAIT_DONE says done (or the time is short): the timed runs start"
  fi
  local append=()
  for entry in ${COST_PLAN:-fp8-static:2 awq:1}; do
    m=${entry%%:*} r=${entry##*:}
    [ "$(left "$deadline")" -gt 300 ] || { log "E: no time left for $m"; continue; }
    log "E: $m, both tools, $r run(s) each, output sealed while written (timed, alone)"
    cost "quantize_cost_${SHAPE}_sealed" "$m" llm-compressor,quantkit "$r" "${append[@]}"
    append=(--append)
  done
  if [ "$WIDE" = 1 ] && [ "$(left "$deadline")" -gt 600 ]; then
    rm -rf "$WORK/src-$SHAPE"  # the disk holds the 8B source or the 70B layer shapes, not all of them
    for s in 70b-4l 70b-8l; do
      python3 bench/quantize_cost.py --shape "$s" --samples "$SAMPLES" --seq-len "$SEQ_LEN" --prepare \
        > "$LOGS/prepare_$s.log" 2>&1
      log "prepare $s exited $?"
      python3 bench/quantize_cost.py --shape "$s" --samples "$SAMPLES" --seq-len "$SEQ_LEN" --methods gptq,awq \
        --tools quantkit --results-dir "$LOGS/results" >> "$LOGS/quantize.log" 2>&1
      log "quantize_cost $s exited $?"
      rm -rf "$WORK/src-$s"
    done
    python3 bench/project.py --short "$LOGS/results/quantize_cost_70b-4l.json" \
      --long "$LOGS/results/quantize_cost_70b-8l.json" --results-dir "$LOGS/results" >> "$LOGS/quantize.log" 2>&1
    log "project exited $?"
  fi
  log "done"
}

last_job() {  # $1 = epoch second after which no step starts. What issue 25 left of the 8B shape's measurements.
  local deadline=$1 fp8="$WORK/out-quantkit-fp8-static" mo="$WORK/out-trt-fp8"
  enter_snapshot
  log "I: the 8B shape, then its FP8 static artifact and (once ModelOpt is there) build-trt FP8 (untimed)"
  python3 bench/quantize_cost.py --shape 8b --samples "$SAMPLES" --seq-len "$SEQ_LEN" --prepare > "$LOGS/prepare.log" 2>&1
  log "prepare 8b exited $?"
  python3 -m quantkit fp8 "$WORK/src-8b" "$fp8" --scheme static --force --json > "$LOGS/results/make_fp8_8b.json" \
    2> "$LOGS/make_fp8_8b.err" &
  until [ -d /tmp/site-trt/modelopt ] || [ "$(left "$deadline")" -le 900 ]; do sleep 5; done
  if [ -d /tmp/site-trt/modelopt ]; then
    python3 -m quantkit build-trt bench/recipes/trt-fp8-8b.yaml -o "$mo" --checkpoint-only \
      --python "$SNAP/bench/.trt-python" --force --json > "$LOGS/results/build_trt_8b.json" 2> "$LOGS/build_trt_8b.err"
    log "build-trt exited $?"
  else
    log "ModelOpt did not arrive: build-trt not run"
  fi
  wait
  log "FP8 static made: $(tail -n 1 "$LOGS/make_fp8_8b.err" | cut -c1-160)"
  until [ -f /tmp/site/.assembled ] || [ "$(left "$deadline")" -le 600 ]; do sleep 5; done
  log "J: GPTQ and INT8 SmoothQuant, both tools, once each (timed, alone)"
  local append=() m
  for m in gptq int8-sq; do
    [ "$(left "$deadline")" -gt 300 ] || { log "J: no time left for $m"; continue; }
    cost quantize_cost_8b_gptq_int8 "$m" llm-compressor,quantkit 1 "${append[@]}"
    append=(--append)
  done
  if [ -f /tmp/site/.assembled ] && [ -d "$mo/hf" ] && [ "$(left "$deadline")" -gt 300 ]; then
    log "L: serve_speed of ModelOpt FP8 (hf/) and quantkit's FP8 static, 8B shape, batches $BATCHES (timed, alone)"
    timeout $(( $(left "$deadline") + 60 )) python3 bench/serve_speed.py "$mo/hf" "$fp8" --batches "$BATCHES" \
      --python "$SNAP/bench/.vllm-python" --name serve_speed_modelopt_8b --results-dir "$LOGS/results" \
      --logs "$LOGS/serve" >> "$LOGS/serve.log" 2>&1
    log "serve_speed exited $?"
  else
    log "vLLM, the ModelOpt export or the time missing: serving not run"
  fi
  log "timed runs done"
  if [ -f /tmp/site/.assembled ] && [ -d "$mo/hf" ] && [ "$(left "$deadline")" -gt 180 ]; then
    log "K: both FP8 exports of the 8B shape scored in vLLM on the held-out text (untimed)"
    QUANTKIT_VLLM_ARGS='{"gpu_memory_utilization": 0.4}' timeout $(( $(left "$deadline") + 120 )) \
      python3 -m quantkit eval "$mo/hf" "$fp8" --baseline "$WORK/src-8b" --engine vllm \
      --python "$SNAP/bench/.vllm-python" --dataset heldout --max-tokens 16384 --max-kld 10 --max-ppl-ratio 10 \
      --min-top1 0 --report-dir "$LOGS/results/eval_fp8_8b" --json > "$LOGS/results/eval_fp8_8b.json" 2> "$LOGS/eval.err"
    log "eval exited $?"
  fi
  log "done"
}

case "${1:-}" in
  llmc|part|vllm)
    device_verb "$1" ;;
  start)
    start_job h200_hopper.sh job "${2:-25}" serve ;;
  start-cost)
    start_job h200_hopper.sh cost-job "${2:-25}" ;;
  start-last)
    start_job h200_hopper.sh last-job "${2:-25}" serve ;;
  last-job)
    last_job "$2" ;;
  job)
    job "$2" ;;
  cost-job)
    cost_job "$2" ;;
  status)
    cat "$LOGS/job.log" 2>/dev/null; tail -n 3 "$LOGS"/{quantize,serve}.log "$LOGS/tune.err" 2>/dev/null
    tail -n 2 "$WORK"/*.log 2>/dev/null | cut -c1-200
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  collect)
    collect_results "$2" serve-gptq serve-w4a8 out-quantkit-fp8-static out-trt-fp8 ;;
  *)
    sed -n '2,38p' "$0"; exit 2 ;;
esac
