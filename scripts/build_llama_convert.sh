#!/usr/bin/env bash
# Put llama.cpp's HF -> GGUF converter (convert_hf_to_gguf.py, its conversion/ package and its own gguf-py) from
# the llama.cpp source that llama-cpp-python vendors into a folder, so converter, gguf library, tools and Python
# library are one llama.cpp commit. Nothing is compiled: quantkit runs the converter with the venv's Python
# (torch, transformers, safetensors, sentencepiece, numpy) and PYTHONPATH = DEST:DEST/gguf-py.
#
#   scripts/build_llama_convert.sh DEST
#
# Environment (set by the Makefile, as for build_llama_tools.sh): PYTHON (a Python with pip), LLAMA_CPP_PYTHON,
# LLAMA_CPP_SDIST_SHA256, LLAMA_CPP_COMMIT, LLAMA_CPP_BUILD. The sdist is checked against its pinned sha256 and
# its CHANGELOG must name the pinned commit. Files land in DEST.tmp, renamed to DEST only when complete.
set -euo pipefail

dest=${1:?usage: build_llama_convert.sh DEST}
: "${PYTHON:?}" "${LLAMA_CPP_PYTHON:?}" "${LLAMA_CPP_SDIST_SHA256:?}" "${LLAMA_CPP_COMMIT:?}" "${LLAMA_CPP_BUILD:?}"
short=${LLAMA_CPP_COMMIT:0:9}

work=$(mktemp -d "${TMPDIR:-/tmp}/quantkit-llama-convert.XXXXXX")
trap 'rm -rf "$work" "$dest.tmp"' EXIT

echo "llama.cpp converter: downloading the llama-cpp-python $LLAMA_CPP_PYTHON sdist"
"$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON"
sdist="$work/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz"
echo "$LLAMA_CPP_SDIST_SHA256  $sdist" | sha256sum --quiet -c - || {
    echo "error: $sdist does not have the pinned sha256 $LLAMA_CPP_SDIST_SHA256" >&2; exit 1; }
top="llama_cpp_python-$LLAMA_CPP_PYTHON"
llama="$top/vendor/llama.cpp"
tar -xzf "$sdist" -C "$work" "$top/CHANGELOG.md" "$llama/LICENSE" "$llama/convert_hf_to_gguf.py" \
    "$llama/conversion" "$llama/gguf-py/gguf" "$llama/gguf-py/LICENSE"
sed -n "/^## \[$LLAMA_CPP_PYTHON\]/,/^## \[/p" "$work/$top/CHANGELOG.md" | grep -q "llama.cpp@$short" || {
    echo "error: llama-cpp-python $LLAMA_CPP_PYTHON's CHANGELOG does not name llama.cpp@$short" >&2; exit 1; }

rm -rf "$dest.tmp"
mkdir -p "$dest.tmp/gguf-py"
src="$work/$llama"
cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/LICENSE" "$dest.tmp/"
cp -r "$src/gguf-py/gguf" "$src/gguf-py/LICENSE" "$dest.tmp/gguf-py/"
# The converter must import with the venv's Python before the folder counts as installed.
PYTHONPATH="$dest.tmp:$dest.tmp/gguf-py" "$PYTHON" -P -c \
    "import convert_hf_to_gguf, gguf, sys; assert gguf.__file__.startswith(sys.argv[1]), gguf.__file__" \
    "$dest.tmp" || { echo "error: the converter does not import with $PYTHON" >&2; exit 1; }
"$PYTHON" - "$dest.tmp/BUILD.json" <<EOF
import json, sys
json.dump({"llama_cpp_python": "$LLAMA_CPP_PYTHON", "sdist_sha256": "$LLAMA_CPP_SDIST_SHA256",
           "commit": "$LLAMA_CPP_COMMIT", "build_number": $LLAMA_CPP_BUILD,
           "converter": "convert_hf_to_gguf.py", "gguf_py": "gguf-py"}, open(sys.argv[1], "w"), indent=2)
EOF
find "$dest.tmp" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "llama.cpp converter: installed in $dest"
