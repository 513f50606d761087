#!/usr/bin/env bash
# Issue 7 on the lent H200: build ModelOpt's unified FP8 checkpoint of the reference model and of an 8B-shaped
# model ON THE GPU with `quantkit build-trt`, then serve each in vLLM (quantization="modelopt") with
# `quantkit smoke` and evaluate it with `quantkit eval`. Nothing here is run by the CPU test suite.
#
# One stage per device call (each must end within the 600 s a call may run; /tmp survives while the machine is
# held). From the repository root:
#
#   here:  bash scripts/gpu_trt.sh wheels          # ModelOpt + transformers 5.14.1 wheels for Python 3.12, cut
#                                                  # into .tw00/p00, .tw01/p01, ... (git-ignored, 32 MiB each)
#   H200:  bash scripts/gpu_trt.sh part            # once per part, carrying that one folder (carry: [".tw00"]);
#                                                  # the last call installs into /tmp/site-trt
#   H200:  bash scripts/gpu_trt.sh build-tiny      # out/trt-fp8-gpu   (recipes/trt-fp8.yaml, --checkpoint-only)
#   H200:  bash scripts/gpu_trt.sh make-8b         # /tmp/llama-8b-shaped: random bf16 weights, Llama-3-8B layer dims
#   H200:  bash scripts/gpu_trt.sh build-8b        # out/trt-fp8-8b
#   H200:  bash scripts/gpu_trt.sh smoke tiny|8b   # quantkit smoke ART/hf --engine vllm (--quantization modelopt)
#   H200:  bash scripts/gpu_trt.sh eval tiny|8b    # quantkit eval ART/hf --engine vllm against the bf16 source
#
# Results (JSON, logs, reports) go to $OUT (the run tool's folder that comes back), else ./gpu_trt_out.
# Assumes vLLM 0.26.0 is installed in /tmp/site (../shared/device/vllm/README.md) and quantkit's own
# dependencies in /tmp/site-llmc (as scripts/gpu_smoke.py does); override with VLLM_SITE / QK_SITE.
#
# Environments, kept apart because their pins fight: quantkit runs with PYTHONPATH=REPO:$QK_SITE; ModelOpt
# runs through the wrapper /tmp/trt-python (PYTHONPATH=/tmp/site-trt: transformers 5.14.1, the image's torch);
# vLLM through /tmp/vllm-python (PYTHONPATH=$VLLM_SITE: transformers 5.17.0). Never load these exports with
# plain transformers: it ignores quant_method "modelopt" and loads FP8 weights without their scales.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu_trt_out}"
VLLM_SITE="${VLLM_SITE:-/tmp/site}"
QK_SITE="${QK_SITE:-/tmp/site-llmc}"
TRT_SITE=/tmp/site-trt
BIG=/tmp/llama-8b-shaped
mkdir -p "$OUT/logs"

# The ModelOpt environment on top of the image's torch: tried on CPU against torch + transformers 5.17.0 (the
# image's pair), where exactly these were missing. tokenizers 0.22.2 because transformers 5.14.1 refuses >0.23.0.
WHEELS=(
  nvidia-modelopt==0.47.0 transformers==5.14.1 tokenizers==0.22.2 accelerate==1.15.0 omegaconf==2.4.0
  PuLP==3.3.2 nvidia-ml-py==13.615.71 ninja==1.13.2 scipy==1.17.1 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 rich==15.0.0 pygments==2.21.0 markdown-it-py==4.3.0
  mdurl==0.1.2 psutil==7.2.2 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3
  certifi==2026.10.19.post1 idna==3.20
)

qk() {  # quantkit in its own environment
  PYTHONPATH="$REPO:$QK_SITE" python3 -m quantkit "$@"
}

wrappers() {
  printf '#!/bin/sh\nPYTHONPATH=%s exec python3 "$@"\n' "$TRT_SITE" > /tmp/trt-python
  printf '#!/bin/sh\nPYTHONPATH=%s VLLM_USE_FLASHINFER_SAMPLER=0 exec python3 "$@"\n' "$VLLM_SITE" > /tmp/vllm-python
  chmod +x /tmp/trt-python /tmp/vllm-python
}

art_of() {
  case "$1" in
    tiny) echo "out/trt-fp8-gpu" ;;
    8b) echo "out/trt-fp8-8b" ;;
    *) echo "unknown model '$1' (tiny or 8b)" >&2; exit 2 ;;
  esac
}

stage="${1:-}"
case "$stage" in
wheels)
  WH=/tmp/qk-trt-wheelhouse
  rm -rf "$WH" && mkdir -p "$WH/wheelhouse"
  PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --only-binary=:all: --no-deps -d "$WH/wheelhouse" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform linux_x86_64 --platform any "${WHEELS[@]}"
  (cd "$WH/wheelhouse" && sha256sum ./*.whl > SHA256SUMS)
  rm -rf "$REPO"/.tw[0-9]*
  tar cf - -C "$WH" wheelhouse | split -b "${PART_MIB:-32}M" -d -a 2 - "$WH/p"
  for p in "$WH"/p[0-9][0-9]; do i="${p##*/p}"; mkdir -p "$REPO/.tw$i" && mv "$p" "$REPO/.tw$i/"; done
  grep -qx '/.tw*/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.tw*/' >> "$REPO/.git/info/exclude"
  ls -d "$REPO"/.tw[0-9]* | xargs -n1 basename
  ;;
part)
  mkdir -p /tmp/twp
  for d in "$REPO"/.tw[0-9]*; do [ -d "$d" ] && mv "$d"/p* /tmp/twp/; done
  ls /tmp/twp
  if ! cat /tmp/twp/p* | tar tf - >/dev/null 2>&1; then echo "parts so far: $(ls /tmp/twp | tr '\n' ' ')"; exit 0; fi
  rm -rf /tmp/tw && mkdir -p /tmp/tw && cat /tmp/twp/p* | tar xf - -C /tmp/tw
  (cd /tmp/tw/wheelhouse && sha256sum --quiet -c SHA256SUMS)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$TRT_SITE" /tmp/tw/wheelhouse/*.whl
  wrappers
  /tmp/trt-python -c "import modelopt.torch.quantization, modelopt.torch.export, transformers, torch; \
print('modelopt ok; transformers', transformers.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  ;;
build-tiny)
  wrappers
  # the shipped recipe, written to out/trt-fp8-gpu so it stays apart from a CPU build
  sed 's#^output: .*#output: out/trt-fp8-gpu#' recipes/trt-fp8.yaml > /tmp/trt-fp8-gpu.yaml
  QUANTKIT_TRT_PYTHON=/tmp/trt-python qk build-trt /tmp/trt-fp8-gpu.yaml --checkpoint-only --force --json \
    > "$OUT/build-tiny.json" 2> "$OUT/logs/build-tiny.log" || { tail -40 "$OUT/logs/build-tiny.log"; exit 1; }
  cat "$OUT/build-tiny.json"
  ;;
make-8b)
  # Llama-3-8B's layer shapes (hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336) with the reference
  # tokenizer's 8192-token vocabulary, random weights: enough to prove vLLM loads and runs the FP8 export at scale.
  rm -rf "$BIG" && python3 - "$BIG" <<'PY'
import shutil, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
out = sys.argv[1]
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=8192, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)
t = time.time()
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out, max_shard_size="5GB")
for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(f"models/quantkit-tiny/{f}", out)
print(f"{sum(p.numel() for p in model.parameters())/1e9:.2f}B parameters written to {out} in {time.time()-t:.0f}s")
PY
  du -sh "$BIG"
  ;;
build-8b)
  wrappers
  cat > /tmp/trt-fp8-8b.yaml <<EOF
# FP8 + FP8 KV cache of the 8B-shaped model, on the GPU.
model:
  source: $BIG
output: out/trt-fp8-8b
quantize: {method: trt, quantization: fp8, kv_cache: fp8}
calibration: {dataset: mixed, samples: 64, seq_len: 512}
EOF
  QUANTKIT_TRT_PYTHON=/tmp/trt-python qk build-trt /tmp/trt-fp8-8b.yaml --checkpoint-only --force --json \
    > "$OUT/build-8b.json" 2> "$OUT/logs/build-8b.log" || { tail -40 "$OUT/logs/build-8b.log"; exit 1; }
  cat "$OUT/build-8b.json"; du -sh out/trt-fp8-8b/*
  ;;
smoke)
  wrappers
  art="$(art_of "${2:-}")"
  extra=()
  [ "${2}" = 8b ] && extra=(--max-model-len 2048 --gpu-memory-utilization 0.5)
  qk smoke "$art/hf" --engine vllm --python /tmp/vllm-python --server-arg=--quantization=modelopt \
    --timeout 420 --log-dir "$OUT/logs/smoke-$2" "${extra[@]}" --json > "$OUT/smoke-$2.json" \
    2> "$OUT/logs/smoke-$2.stderr" || true
  cat "$OUT/smoke-$2.json"; tail -20 "$OUT/logs/smoke-$2.stderr"
  ;;
eval)
  wrappers
  art="$(art_of "${2:-}")"
  if [ "${2}" = 8b ]; then base="$BIG"; toks=8192; else base=models/quantkit-tiny; toks=32768; fi
  # exit 3 (a gate failed) still wrote the report: random 8B weights make the gates meaningless, the numbers not
  QUANTKIT_VLLM_PYTHON=/tmp/vllm-python qk eval "$art/hf" --engine vllm --python /tmp/vllm-python \
    --baseline "$base" --dataset heldout --ctx 2048 --max-tokens "$toks" --report-dir "$OUT/eval-$2" --json \
    > "$OUT/eval-$2.json" 2> "$OUT/logs/eval-$2.stderr" || echo "quantkit eval exited $?"
  cat "$OUT/eval-$2.json"; tail -20 "$OUT/logs/eval-$2.stderr"
  ;;
*)
  sed -n '2,25p' "$0"; exit 2 ;;
esac
