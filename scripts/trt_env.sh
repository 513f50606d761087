#!/usr/bin/env bash
# The ModelOpt environment the GPU cases' build-trt steps need (scripts/gpu_cases.yaml, needs: [trt]): ModelOpt
# 0.47 pins transformers < 5.15 while llm-compressor 0.14 needs >= 5.15, so it lives in its own folder,
# /tmp/site-trt, on top of the GPU image's torch. scripts/gpu_cases.py runs it through a wrapper that sets
# PYTHONPATH=/tmp/site-trt (its --trt-site).
#
#   here:  bash scripts/trt_env.sh wheels     # ModelOpt + transformers 5.14.1 wheels for Python 3.12, cut into
#                                             # .tw00/p00, .tw01/p01, ... (git-ignored, PART_MIB each:
#                                             # 25 by default, 26 at most: part + tracked tree (34 MiB) <= 60)
#   GPU:   bash scripts/trt_env.sh part       # once per part, carrying that one folder (carry: [".tw00"]);
#                                             # the call that brings the last part installs into /tmp/site-trt
#
# The machine has no network and takes at most 64 MiB per transfer; /tmp survives while the machine is held.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
TRT_SITE="${TRT_SITE:-/tmp/site-trt}"

# Tried on CPU against torch + transformers 5.17.0 (the image's pair), where exactly these were missing.
# tokenizers 0.22.2 because transformers 5.14.1 refuses > 0.23.0.
WHEELS=(
  nvidia-modelopt==0.47.0 transformers==5.14.1 tokenizers==0.22.2 accelerate==1.15.0 omegaconf==2.4.0
  PuLP==3.3.2 nvidia-ml-py==13.615.71 ninja==1.13.2 scipy==1.17.1 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 rich==15.0.0 pygments==2.21.0 markdown-it-py==4.3.0
  mdurl==0.1.2 psutil==7.2.2 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3
  certifi==2026.10.19.post1 idna==3.20
)

case "${1:-}" in
wheels)
  WH=/tmp/qk-trt-wheelhouse
  rm -rf "$WH" && mkdir -p "$WH/wheelhouse"
  PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --only-binary=:all: --no-deps -d "$WH/wheelhouse" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform linux_x86_64 --platform any "${WHEELS[@]}"
  (cd "$WH/wheelhouse" && sha256sum ./*.whl > SHA256SUMS)
  rm -rf "$REPO"/.tw[0-9]*
  tar cf - -C "$WH" wheelhouse | split -b "${PART_MIB:-25}M" -d -a 2 - "$WH/p"
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
  PYTHONPATH="$TRT_SITE" python3 -c "import modelopt.torch.quantization, modelopt.torch.export, transformers, torch; \
print('modelopt ok; transformers', transformers.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  ;;
*)
  sed -n '2,12p' "$0"; exit 2 ;;
esac
