#!/usr/bin/env bash
# Quantize a model into every compressed-tensors format quantkit writes (GPU machine, from the repo root).
# Used for the README's vLLM table:  bash scripts/gpu_quantize_all.sh MODEL OUTDIR
# quantkit runs with llm-compressor's wheels in /tmp/site-llmc (../shared/device/llmcompressor/README.md).
set -u
MODEL=${1:-models/quantkit-tiny}
OUT=${2:-/tmp/arts}
export PYTHONPATH="$PWD:/tmp/site-llmc" HF_HUB_OFFLINE=1
q() { local name=$1; shift; echo "== $name"; python3 -m quantkit --quiet "$@" "$MODEL" "$OUT/$name" --force --json > "$OUT/$name.json" 2> "$OUT/$name.err" || { echo "FAILED $name"; tail -5 "$OUT/$name.err"; }; }
mkdir -p "$OUT"
q rtn-w4g128 rtn
q awq-w4g128 awq
q gptq-w4g128 gptq
q gptq-w8g128 gptq --bits 8
q fp8-static fp8
q fp8-dynamic fp8 --scheme dynamic
q fp8-block fp8 --scheme block
q int8-sq int8
q awq-legacy awq --format autoawq
q gptq-legacy gptq --format gptq
ls "$OUT"
