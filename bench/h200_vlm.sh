#!/usr/bin/env bash
# Issue 27 on one lent H200: the vision-language cases of scripts/gpu_cases.yaml (tag vlm), in one background job
# started once vLLM's parts are there. The tiny checkpoints are made there by tests/vlm_models.py (transformers and
# torchvision are in the image, so their processors are complete there).
#
#   here first: PART_MIB=25 bash ../shared/device/vllm/build.sh, .whl-llmc as in
#   ../shared/device/llmcompressor/README.md; then there, one call each carrying .vw00 (+ .whl-llmc) ... .vw13:
#   bash bench/h200_vlm.sh take                  # install .whl-llmc; move the carried part to /tmp (every call)
#   bash bench/h200_vlm.sh vllm                  # after the last .vw part: assemble vLLM into /tmp/site
#   bash bench/h200_vlm.sh start [MINUTES] [ONLY]  # the job: gpu_cases --only ONLY (vlm); nothing starts after MINUTES
#   bash bench/h200_vlm.sh status | wait SECONDS "$OUT" | collect "$OUT"
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
. "$REPO/bench/device.sh"
SNAP=/tmp/qk-vlm-snap
LOGS=/tmp/qk-vlm-logs
GPU_OUT=/tmp/qk-gpu-vlm
PARALLEL="${PARALLEL:-4}"

job() {  # $1 = epoch second after which no step starts, $2 = gpu_cases --only
  local deadline=$1 only=$2
  enter_snapshot
  until [ -f /tmp/site/.assembled ] || [ "$(left "$deadline")" -le 120 ]; do sleep 5; done
  [ -f /tmp/site/.assembled ] || { log "vLLM not assembled in time: no case run"; return; }
  log "gpu_cases --only $only, budget $(left "$deadline") s"
  # --shared-gpu: the SGLang job may run beside it (its servers' exits trip vLLM's memory profiling: run 5)
  python3 scripts/gpu_cases.py --out "$GPU_OUT" --only "$only" --budget "$(left "$deadline")" --parallel "$PARALLEL" \
    --shared-gpu > "$LOGS/gpu_cases.log" 2>&1
  log "gpu_cases exited $?"
}

case "${1:-}" in
  take)
    [ -d "$REPO/.whl-llmc" ] && install_llmc && echo "llm-compressor installed"
    take_parts ;;
  start)
    export ONLY="${3:-vlm}"
    start_job h200_vlm.sh job "${2:-20}" && echo "only: $ONLY" ;;
  job)
    job "$2" "${ONLY:-vlm}" ;;
  vllm)
    assemble_vllm ;;
  status)
    cat "$LOGS/job.log" 2>/dev/null
    gpu_cases_verb status ;;
  wait)  # wait SECONDS DEST: block until the cases end (or SECONDS), then collect into DEST
    gpu_cases_verb wait "$2" "$3" gpu_cases.log ;;
  collect)
    gpu_cases_verb collect "$2" gpu_cases.log ;;
  *)
    sed -n '2,11p' "$0"; exit 2 ;;
esac
