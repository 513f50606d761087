#!/usr/bin/env bash
# Issue 14 item 4 on one lent H200, as bench/h200_moe_plan.md lays it out: the MoE quantization cost, the MoE
# serving speed and the MoE reference model's GPU cases, one after the other in a background job that outlives the
# device call which starts it, while later calls bring vLLM's wheel parts. Every step writes its results as it goes;
# `status` shows them, `collect DEST` packs them into few files for $OUT.
#
#   bash bench/h200_moe.sh llmc               # install .whl-llmc into /tmp/site-llmc (first call)
#   bash bench/h200_moe.sh start [MINUTES]    # start the job; it must end within MINUTES (default 26)
#   bash bench/h200_moe.sh part               # move the carried .vwNN/p* to /tmp/vwp (one call per part)
#   bash bench/h200_moe.sh vllm               # assemble vLLM into /tmp/site once every part is there
#   bash bench/h200_moe.sh status | collect "$OUT"
#
# The job runs from a snapshot of the repository (/tmp/qk-moe), because each device call re-sends the working tree.
# Order: (0) the MoE reference model trained (models/scripts/train_moe.py, untimed; needs .train/ carried) while
# (1) the 12-layer Qwen3-30B-A3B-wide checkpoint and its tokens are built (untimed); (2) quantize_cost, GPTQ and FP8,
# quantkit and llm-compressor (timed, alone on the GPU); (3) once vLLM is assembled, scripts/gpu_cases.py --only moe
# on the freshly trained model (untimed, 4 cases at once, CASES_S seconds at most); (4) serve_speed for bf16, W4A16
# and FP8 (timed, alone) with the time left.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
. "$REPO/bench/device.sh"
SNAP=/tmp/qk-moe
LOGS=/tmp/qk-moe-logs
WORK=/tmp/quantkit-bench-qcost
SHAPE="${SHAPE:-qwen3-30b-a3b-12l}"  # SHAPE=moe-tiny SAMPLES=4 SEQ_LEN=64 tries the job on a CPU
SAMPLES="${SAMPLES:-32}"
SEQ_LEN="${SEQ_LEN:-2048}"
CASES_S="${CASES_S:-420}"

job() {  # the background job; $1 = epoch second by which it must be done
  local deadline=$1
  cd "$SNAP" || exit 1
  export PYTHONPATH="$SNAP:/tmp/site-llmc"
  log "train the MoE reference model, and prepare $SHAPE, $SAMPLES x $SEQ_LEN tokens"
  python3 models/scripts/train_moe.py --out "$LOGS/quantkit-tiny-moe" > "$LOGS/train.log" 2>&1 &
  local trainer=$!
  python3 bench/quantize_cost.py --shape "$SHAPE" --samples "$SAMPLES" --seq-len "$SEQ_LEN" --prepare >> "$LOGS/quantize.log" 2>&1
  wait "$trainer"
  log "train_moe exited $?"
  cp -r "$LOGS/quantkit-tiny-moe" "$SNAP/models/quantkit-tiny-moe"
  log "quantize_cost (timed)"
  python3 bench/quantize_cost.py --shape "$SHAPE" --samples "$SAMPLES" --seq-len "$SEQ_LEN" --keep quantkit \
    --results-dir "$LOGS/results" >> "$LOGS/quantize.log" 2>&1
  log "quantize_cost exited $?; waiting for vLLM"
  until [ -f /tmp/site/.assembled ] || [ "$(date +%s)" -ge "$deadline" ]; do sleep 5; done
  if [ -f /tmp/site/.assembled ]; then
    log "gpu_cases --only moe, budget $CASES_S s"
    python3 scripts/gpu_cases.py --only moe --out /tmp/qk-gpu-moe --budget "$CASES_S" >> "$LOGS/cases.log" 2>&1
    log "gpu_cases exited $?"
    log "serve_speed (timed)"
    timeout $(( deadline - $(date +%s) )) python3 bench/serve_speed.py "$WORK/src-$SHAPE" \
      "$WORK/out-quantkit-gptq" "$WORK/out-quantkit-fp8-static" --vllm-site /tmp/site --name serve_speed_moe \
      --results-dir "$LOGS/results" --logs "$LOGS/serve" >> "$LOGS/serve.log" 2>&1
    log "serve_speed exited $?"
  else
    log "vLLM was not assembled in time: serve_speed and the MoE cases not run"
  fi
  log "done"
}

case "${1:-}" in
  llmc|part|vllm)
    device_verb "$1" ;;
  start)
    start_job h200_moe.sh job "${2:-26}" ;;
  job)
    job "$2" ;;
  status)
    cat "$LOGS/job.log" 2>/dev/null; tail -n 3 "$LOGS"/{quantize,serve,cases}.log 2>/dev/null
    cat "$LOGS"/results/*.md 2>/dev/null; nvidia-smi --query-gpu=memory.used --format=csv,noheader ;;
  collect)
    mkdir -p "$2"
    tar -C "$LOGS" -czf "$2/bench-moe.tar.gz" job.log results quantize.log serve.log train.log \
      $(cd "$LOGS" && ls -d serve 2>/dev/null) 2>/dev/null
    [ -f "$LOGS/quantkit-tiny-moe/model.safetensors" ] && tar -C "$LOGS" -cf "$2/quantkit-tiny-moe.tar" quantkit-tiny-moe
    tar -C "$WORK" -czf "$2/quantize-logs.tar.gz" $(cd "$WORK" && ls ./*.log 2>/dev/null) 2>/dev/null
    [ -d /tmp/qk-gpu-moe ] && python3 "$SNAP/scripts/gpu_cases.py" --collect "$2" --out /tmp/qk-gpu-moe
    ls -la "$2" ;;
  *)
    sed -n '2,16p' "$0"; exit 2 ;;
esac
