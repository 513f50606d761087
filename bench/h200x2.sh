#!/usr/bin/env bash
# Issue 18 on a lent nvidia-h200-x2 (two H200s of one host): distributed calibration and tensor-parallel serving,
# one background job started by the first device call while later calls bring the ModelOpt and vLLM wheel parts.
#
#   here first: PART_MIB=25 bash ../shared/device/vllm/build.sh; PART_MIB=25 bash scripts/trt_env.sh wheels
#   (at most 26 MiB: part + the 34 MiB tracked tree must stay under 60 MiB), and .whl-llmc as in bench/h200_moe_plan.md
#   bash bench/h200x2.sh llmc                 # install .whl-llmc into /tmp/site-llmc (first call)
#   bash bench/h200x2.sh start [MINUTES]      # start the job; nothing starts after MINUTES (default 26)
#   bash bench/h200x2.sh part                 # move the carried .tw*/p* and .vw*/p* parts to /tmp (one call each)
#   bash bench/h200x2.sh vllm                 # assemble vLLM into /tmp/site once every part is there
#   bash bench/h200x2.sh status | collect "$OUT"
#
# The job, from a snapshot of the repository (/tmp/qk-x2; each device call re-sends the working tree):
#   A  untimed, side by side: bench/ddp_agreement.py (GPTQ and AWQ of the reference model on 1 and 2 GPUs, scored
#      on the held-out text) while the 8B shape is built (bench/quantize_cost.py --prepare); then the 8B FP8-dynamic
#      artifact (quantkit fp8, for serving) on GPU 1 beside build-trt FP8 with tp=2 (bench/recipes/
#      trt-fp8-8b-tp2.yaml, ModelOpt from /tmp/site-trt) on GPU 0; then, once vLLM is there, quantkit smoke --tp 2
#      of the FP8 and ModelOpt (hf/) 8B artifacts (random weights: the server loads and answers, with empty text).
#   B  timed, alone: bench/quantize_cost.py on the 8B shape, GPTQ with quantkit on 2 and 1 GPUs and llm-compressor's
#      DDP example on 2; with AWQ8B=1 also AWQ with quantkit on 2 and 1 GPUs (about 5 more minutes).
#   C  timed, alone: bench/serve_speed.py, the 2-GPU GPTQ artifact and the FP8 artifact at tp=1 and tp=2.
#   D  untimed: quantkit smoke --tp 2 --baseline source of the reference model's GPTQ artifact made on 2 GPUs (real
#      text, compared with transformers), beside the 8B GPTQ artifact made on 2 GPUs.
# bench/results/h200x2/README.md says what one 30-minute lease of this gave.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
. "$REPO/bench/device.sh"
SNAP=/tmp/qk-x2
LOGS=/tmp/qk-x2-logs
WORK=/tmp/quantkit-bench-qcost
SAMPLES="${SAMPLES:-32}"
SEQ_LEN="${SEQ_LEN:-2048}"
AWQ8B="${AWQ8B:-0}"

smoke() {  # smoke NAME FOLDER [extra quantkit smoke flags]: vLLM from /tmp/site, tp=2, a quarter of each GPU
  local name=$1 folder=$2; shift 2
  python3 -m quantkit smoke "$folder" --engine vllm --tp 2 --python "$SNAP/bench/.vllm-python" \
    --gpu-memory-utilization 0.25 --log-dir "$LOGS/smoke" --json "$@" \
    > "$LOGS/results/smoke_$name.json" 2> "$LOGS/smoke_$name.err"
  log "smoke $name exited $?"
}

job() {  # $1 = epoch second after which no step starts
  local deadline=$1
  enter_snapshot

  log "A: ddp_agreement beside the 8B shape's preparation ($SAMPLES x $SEQ_LEN tokens)"
  python3 bench/ddp_agreement.py --results-dir "$LOGS/results" > "$LOGS/agreement.log" 2>&1 &
  local agree=$!
  python3 bench/quantize_cost.py --shape 8b --samples "$SAMPLES" --seq-len "$SEQ_LEN" --prepare \
    > "$LOGS/prepare.log" 2>&1
  log "prepare exited $?"
  CUDA_VISIBLE_DEVICES=1 python3 -m quantkit fp8 "$WORK/src-8b" "$WORK/out-quantkit-fp8-dynamic" --scheme dynamic \
    --force --json > "$LOGS/fp8.json" 2> "$LOGS/fp8.err" &
  local fp8=$!
  local trt_by=$(( $(date +%s) + 180 ))  # ModelOpt's parts come with the first device calls; wait 3 min at most
  until [ -d /tmp/site-trt/modelopt ] || [ "$(date +%s)" -ge "$trt_by" ]; do sleep 5; done
  if [ -d /tmp/site-trt/modelopt ]; then
    log "build-trt fp8 tp=2 (GPU 0)"
    CUDA_VISIBLE_DEVICES=0 python3 -m quantkit build-trt bench/recipes/trt-fp8-8b-tp2.yaml -o "$WORK/out-trt-fp8-tp2" \
      --checkpoint-only \
      --python "$SNAP/bench/.trt-python" --force --json > "$LOGS/results/build_trt_tp2.json" 2> "$LOGS/build_trt.err"
    log "build-trt exited $?"
  else
    log "ModelOpt did not arrive in time: build-trt not run"
  fi
  wait "$fp8"; log "fp8 dynamic exited $?"
  until [ -f /tmp/site/.assembled ] || [ "$(left "$deadline")" -le 900 ]; do sleep 5; done
  if [ -f /tmp/site/.assembled ]; then
    smoke fp8 "$WORK/out-quantkit-fp8-dynamic" --max-model-len 2048 &
    sleep 5
    [ -d "$WORK/out-trt-fp8-tp2/hf" ] && smoke modelopt "$WORK/out-trt-fp8-tp2/hf" --max-model-len 2048 \
      --server-arg=--quantization=modelopt &
  fi
  wait  # the agreement runs and the early smokes: nothing untimed is left on the GPUs when B starts
  log "ddp_agreement and the early smokes done"

  log "B: quantization cost on 1 and 2 GPUs (timed, alone)"
  python3 bench/quantize_cost.py --shape 8b --samples "$SAMPLES" --seq-len "$SEQ_LEN" --methods gptq \
    --tools quantkit@2,llm-compressor@2,quantkit@1 --keep quantkit --name quantize_cost_8b_x2 \
    --results-dir "$LOGS/results" >> "$LOGS/quantize.log" 2>&1
  log "quantize_cost gptq exited $?"
  if [ "$AWQ8B" = 1 ] && [ "$(left "$deadline")" -gt 600 ]; then
    python3 bench/quantize_cost.py --shape 8b --samples "$SAMPLES" --seq-len "$SEQ_LEN" --methods awq \
      --tools quantkit@2,quantkit@1 --name quantize_cost_8b_x2 --append --results-dir "$LOGS/results" \
      >> "$LOGS/quantize.log" 2>&1
    log "quantize_cost awq exited $?"
  else
    log "AWQ on the 8B shape not run (AWQ8B=$AWQ8B, $(left "$deadline") s left)"
  fi

  until [ -f /tmp/site/.assembled ] || [ "$(left "$deadline")" -le 0 ]; do sleep 5; done
  if [ ! -f /tmp/site/.assembled ]; then
    log "vLLM was not assembled in time: serving not run"; log "done"; return
  fi
  if [ "$(left "$deadline")" -le 0 ]; then log "deadline passed: serving not run"; log "done"; return; fi
  log "C: serve_speed tp=1 and tp=2 (timed, alone)"
  timeout $(( $(left "$deadline") + 120 )) python3 bench/serve_speed.py "$WORK/out-quantkit-gptq-x2" \
    "$WORK/out-quantkit-fp8-dynamic" --tp 1,2 --python "$SNAP/bench/.vllm-python" --name serve_speed_8b_tp \
    --results-dir "$LOGS/results" --logs "$LOGS/serve" >> "$LOGS/serve.log" 2>&1
  log "serve_speed exited $?"

  if [ "$(left "$deadline")" -le -120 ]; then log "deadline passed: smoke not run"; log "done"; return; fi
  log "D: quantkit smoke --tp 2"
  smoke tiny_gptq_tp2 /tmp/quantkit-bench-ddp/gptq-x2-s0 --baseline source &
  sleep 5; smoke gptq "$WORK/out-quantkit-gptq-x2" --max-model-len 2048 &
  wait
  log "done"
}

case "${1:-}" in
  llmc|part|vllm)
    device_verb "$1" ;;
  start)
    start_job h200x2.sh job "${2:-26}" smoke ;;
  job)
    job "$2" ;;
  status)
    cat "$LOGS/job.log" 2>/dev/null; tail -n 2 "$LOGS"/{agreement,quantize,serve}.log 2>/dev/null
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  collect)
    collect_results "$2" out-quantkit-gptq out-quantkit-gptq-x2 out-quantkit-fp8-dynamic out-trt-fp8-tp2 ;;
  *)
    sed -n '2,24p' "$0"; exit 2 ;;
esac
