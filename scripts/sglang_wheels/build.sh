#!/usr/bin/env bash
# Build SGLang 0.5.17's offline set for the lent H200 (Python 3.12, torch 2.11.0+cu130; vLLM's set, of which it
# reuses everything but vLLM itself, assembled beside it) and cut it into parts, one folder per device call:
#   .sw00/p00, .sw01/p01, ...   the set (about 38 MiB in 2 parts of 25 MiB)
#   .sf00/p00, ... (FA3=1 only)  sgl-kernel's FlashAttention-3 library (flash_ops, 1.1 GB; about 127 MiB in 6 parts),
#                                without which SGLang must run with --attention-backend triton
# Usage, from the repo root:  bash scripts/sglang_wheels/build.sh   (PART_MIB=N: part size; FA3=1: the FA3 parts)
#
# The wheels are downloaded against the hashes in requirements.txt, installed here into one --target folder for
# cp312 (pip installs another Python's wheels with --python-version/--platform/--only-binary/--no-deps), then tarred
# with xz: xz shrinks the CUDA libraries three times better than the wheels' zip, so fewer parts travel. From
# sglang-kernel only what an H200 loads stays: its sm90/ common_ops (load_utils picks sm90 on compute capability 9.0)
# and the Python files; sm100/ (Blackwell), flashmla_ops (MLA models) and infllm_ops (InfLLM attention) go, and
# flash_ops goes into the FA3 parts; their lines leave the dist-info's RECORD so it lists what is there.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(git rev-parse --show-toplevel)"
WH="${WH:-/tmp/qk-sglang-wheelhouse}"
PART_MIB="${PART_MIB:-25}"
rm -rf "$WH" && mkdir -p "$WH/wheels" "$WH/site" "$WH/set" "$WH/fa3/fa3"
TAGS=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any)
export PIP_CONFIG_FILE=/dev/null
python3 -m pip download -q "${TAGS[@]}" --require-hashes -d "$WH/wheels" -r "$HERE/requirements.txt"
python3 -m pip install -q "${TAGS[@]}" --no-compile --no-warn-script-location --target "$WH/site" "$WH"/wheels/*.whl
rm -rf "$WH/site/bin"  # console scripts name this machine's Python; the device runs python -m
K="$WH/site/sgl_kernel"
mv "$K/flash_ops.abi3.so" "$WH/fa3/fa3/"
rm -rf "$K/sm100" "$K/flashmla_ops.abi3.so" "$K"/infllm_ops*.so
python3 - "$WH/site" <<'EOF'
import glob, os, sys
site = sys.argv[1]
record = glob.glob(os.path.join(site, "sglang_kernel-*.dist-info", "RECORD"))[0]
lines = open(record).read().splitlines()
kept = [ln for ln in lines if os.path.exists(os.path.join(site, ln.split(",")[0]))]
open(record, "w").write("\n".join(kept) + "\n")
print(f"sgl_kernel: {len(lines) - len(kept)} RECORD lines of files left out")
EOF
(cd "$WH/site" && tar --sort=name --owner=0 --group=0 --numeric-owner -cf - .) | xz -9 -T2 > "$WH/set/site.tar.xz"
cp "$HERE/assemble.sh" "$WH/set/"
(cd "$WH/set" && sha256sum site.tar.xz > SHA256SUMS)
rm -rf "$REPO"/.sw[0-9]* "$REPO"/.sf[0-9]*
tar cf - -C "$WH" set | split -b "${PART_MIB}M" -d -a 2 - "$WH/p"
for p in "$WH"/p[0-9][0-9]; do i="${p##*/p}"; mkdir -p "$REPO/.sw$i" && mv "$p" "$REPO/.sw$i/"; done
if [ "${FA3:-0}" = 1 ]; then
  xz -9 -T2 "$WH/fa3/fa3/flash_ops.abi3.so"
  (cd "$WH/fa3/fa3" && sha256sum flash_ops.abi3.so.xz > SHA256SUMS)
  tar cf - -C "$WH/fa3" fa3 | split -b "${PART_MIB}M" -d -a 2 - "$WH/f"
  for p in "$WH"/f[0-9][0-9]; do i="${p##*/f}"; mkdir -p "$REPO/.sf$i" && mv "$p" "$REPO/.sf$i/p$i"; done
fi
for pat in '/.sw*/' '/.sf*/'; do
  grep -qxF "$pat" "$REPO/.git/info/exclude" 2>/dev/null || echo "$pat" >> "$REPO/.git/info/exclude"
done
du -sm "$WH/set/site.tar.xz"
ls -d "$REPO"/.sw[0-9]* "$REPO"/.sf[0-9]* 2>/dev/null | xargs -n1 basename
