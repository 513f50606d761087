# Shared steps of the device jobs (bench/h200_moe.sh, bench/h200x2.sh, bench/h200_hopper.sh, bench/h200_real.sh),
# sourced by them after they set REPO, SNAP (the snapshot the job runs from) and LOGS (its log folder); WORK (where
# the job makes its artifacts) before collect_results.
# The device machine has no network and takes at most 64 MiB per call: wheels travel as git-ignored part folders
# (.vwNN: vLLM, ../shared/device/vllm; .twNN: ModelOpt, scripts/trt_env.sh; .whl-llmc: llm-compressor), and a job
# runs from a snapshot of the repository because every call re-sends the working tree.

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0

log() { echo "[$(date +%H:%M:%S)] $*" >> "$LOGS/job.log"; }
left() { echo $(( $1 - $(date +%s) )); }  # seconds until epoch second $1
# wait_log LOG PATTERN DEADLINE FLOOR: until a line of LOG (another job's) matches PATTERN, or FLOOR seconds are left
wait_log() { until grep -q "$2" "$1" 2>/dev/null || [ "$(left "$3")" -le "$4" ]; do sleep 5; done; }

# start_job SCRIPT VERB MINUTES [SUBFOLDER...]: snapshot the repository, run "SCRIPT VERB DEADLINE" in the background
# from the snapshot (nothing starts after MINUTES), SUBFOLDERs made under LOGS
start_job() {
  local script=$1 verb=$2 minutes=$3 deadline; shift 3
  rm -rf "$SNAP" "$LOGS" && mkdir -p "$SNAP" "$LOGS/results" && for d in "$@"; do mkdir -p "$LOGS/$d"; done
  snapshot "$SNAP"
  deadline=$(( $(date +%s) + 60 * minutes ))
  setsid nohup bash "$SNAP/bench/$script" "$verb" "$deadline" > "$LOGS/nohup.log" 2>&1 < /dev/null &
  echo "started $verb; deadline $(date -d @"$deadline" +%H:%M:%S)"
}

enter_snapshot() {  # the job's working directory and Python paths; bench/.vllm-python runs vLLM's /tmp/site,
  # bench/.trt-python ModelOpt's /tmp/site-trt (scripts/trt_env.sh)
  cd "$SNAP" || exit 1
  export PYTHONPATH="$SNAP:/tmp/site-llmc"
  printf '#!/bin/sh\nexport PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1\nexec python3 "$@"\n' \
    > bench/.vllm-python
  printf '#!/bin/sh\nexport PYTHONPATH=/tmp/site-trt\nexec python3 "$@"\n' > bench/.trt-python
  chmod +x bench/.vllm-python bench/.trt-python
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$LOGS/gpus.csv" 2>&1
}

install_llmc() {  # llm-compressor and its pins into /tmp/site-llmc, apart from vLLM's compressed-tensors
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-llmc "$REPO"/.whl-llmc/*.whl
}

take_parts() {  # move the carried ModelOpt (.tw) or vLLM (.vw) part out of the tree before the next call replaces it
  if ls -d "$REPO"/.tw[0-9]* > /dev/null 2>&1; then bash "$REPO/scripts/trt_env.sh" part; fi
  if ls "$REPO"/.vw[0-9]*/p[0-9]* > /dev/null 2>&1; then
    mkdir -p /tmp/vwp && mv "$REPO"/.vw[0-9]*/p[0-9]* /tmp/vwp/ && ls /tmp/vwp | tr '\n' ' '
  fi
}

assemble_vllm() {  # every part there: install vLLM into /tmp/site and mark it for the job
  mkdir -p /tmp/vw && cat /tmp/vwp/p* | tar xf - -C /tmp/vw && bash /tmp/vw/wheelhouse/assemble.sh \
    && touch /tmp/site/.assembled && echo "vLLM assembled"
}

snapshot() {  # snapshot DEST: the repository without its wheel parts and .git
  tar -C "$REPO" --exclude='./.vw*' --exclude='./.tw*' --exclude='./.whl*' --exclude=./.git -cf - . \
    | tar -C "$1" -xf -
}

device_verb() {  # device_verb llmc|part|vllm: the steps every device script offers under the same verb
  case "$1" in
    llmc) install_llmc ;;
    part) take_parts ;;
    vllm) assemble_vllm ;;
  esac
}

# collect_results DEST ARTIFACT...: the job's results, its logs and the quantize logs under WORK in three archives
# ($OUT takes a limited number of files), with each ARTIFACT's (a folder under WORK) manifest and model card
collect_results() {
  local dest=$1 a; shift
  mkdir -p "$dest"
  tar -C "$LOGS" -czf "$dest/results.tar.gz" results
  tar -C "$LOGS" -czf "$dest/logs.tar.gz" --exclude='*.safetensors' . 2>/dev/null
  tar -C "$WORK" -czf "$dest/quantize-logs.tar.gz" $(cd "$WORK" && ls ./*.log 2>/dev/null) 2>/dev/null
  for a in "$@"; do
    [ -f "$WORK/$a/quantkit.json" ] && cp "$WORK/$a/quantkit.json" "$dest/$a.quantkit.json"
    [ -f "$WORK/$a/README.md" ] && cp "$WORK/$a/README.md" "$dest/$a.README.md"
  done
  ls -la "$dest"
}

# gpu_cases_verb status|wait SECONDS DEST|collect DEST [EXTRA_LOG...]: the scripts/gpu_cases.py job's verbs (after
# SNAP, LOGS and GPU_OUT are set): its table, a wait for its end then collect, or its results with job.log and the
# EXTRA_LOG files of LOGS copied into DEST
gpu_cases_verb() {
  local gc=("python3" "$SNAP/scripts/gpu_cases.py")
  case "$1" in
    status)
      PYTHONPATH="$SNAP:/tmp/site-llmc" "${gc[@]}" --status --out "$GPU_OUT" 2>/dev/null | tail -n 30
      nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
    wait)
      PYTHONPATH="$SNAP:/tmp/site-llmc" "${gc[@]}" --wait "$2" --out "$GPU_OUT" | tail -n 30
      gpu_cases_verb collect "${@:3}" ;;
    collect)
      local dest=$2 f; shift 2
      mkdir -p "$dest"
      for f in job.log "$@"; do cp "$LOGS/$f" "$dest/" 2>/dev/null; done
      PYTHONPATH="$SNAP:/tmp/site-llmc" "${gc[@]}" --collect "$dest" --out "$GPU_OUT"
      ls -la "$dest" ;;
  esac
}

