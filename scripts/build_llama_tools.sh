#!/usr/bin/env bash
# Build llama.cpp's command-line tools (llama-imatrix, llama-quantize, llama-perplexity, llama-server) from the
# llama.cpp source that llama-cpp-python vendors, so the tools and the Python library are one llama.cpp commit.
#
#   scripts/build_llama_tools.sh DEST
#
# Environment (set by the Makefile): PYTHON (a Python with pip), LLAMA_CPP_PYTHON (the pinned llama-cpp-python
# version), LLAMA_CPP_SDIST_SHA256 (its sdist's sha256), LLAMA_CPP_COMMIT and LLAMA_CPP_BUILD (the llama.cpp
# commit and build number that sdist vendors), LLAMA_CMAKE_ARGS (the CPU flags the wheel is built with), JOBS.
#
# The sdist is the one pip builds the wheel from (checked against its pinned sha256), and its CHANGELOG must name
# the pinned commit. An sdist has no git history, so llama.cpp's build would stamp "0 (unknown)": the commit and
# build number are passed in, and the tools' --version reports them. Everything lands in DEST.tmp and is renamed
# to DEST only when complete, so an interrupted build never looks finished.
set -euo pipefail

dest=${1:?usage: build_llama_tools.sh DEST}
: "${PYTHON:?}" "${LLAMA_CPP_PYTHON:?}" "${LLAMA_CPP_SDIST_SHA256:?}" "${LLAMA_CPP_COMMIT:?}" "${LLAMA_CPP_BUILD:?}"
: "${LLAMA_CMAKE_ARGS:?}"
jobs=${JOBS:-2}
tools=(llama-imatrix llama-quantize llama-perplexity llama-server)
short=${LLAMA_CPP_COMMIT:0:9}

work=$(mktemp -d "${TMPDIR:-/tmp}/quantkit-llama-tools.XXXXXX")
trap 'rm -rf "$work" "$dest.tmp"' EXIT

echo "llama.cpp tools: downloading the llama-cpp-python $LLAMA_CPP_PYTHON sdist"
"$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON"
sdist="$work/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz"
echo "$LLAMA_CPP_SDIST_SHA256  $sdist" | sha256sum --quiet -c - || {
    echo "error: $sdist does not have the pinned sha256 $LLAMA_CPP_SDIST_SHA256" >&2; exit 1; }
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$LLAMA_CPP_PYTHON"
# The changelog's entry for this version names the llama.cpp commit it vendors.
sed -n "/^## \[$LLAMA_CPP_PYTHON\]/,/^## \[/p" "$src/CHANGELOG.md" | grep -q "llama.cpp@$short" || {
    echo "error: llama-cpp-python $LLAMA_CPP_PYTHON's CHANGELOG does not name llama.cpp@$short" >&2; exit 1; }

# Static tools (no shared libraries to find at run time); no web UI (it would be downloaded), no OpenSSL.
# shellcheck disable=SC2086 # LLAMA_CMAKE_ARGS is a list of -D flags
cmake -S "$src/vendor/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release $LLAMA_CMAKE_ARGS \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_NUMBER="$LLAMA_CPP_BUILD" -DLLAMA_BUILD_COMMIT="$short" >"$work/configure.log" 2>&1 || {
    tail -30 "$work/configure.log" >&2; exit 1; }
echo "llama.cpp tools: compiling ${tools[*]} (b$LLAMA_CPP_BUILD, $short) with $jobs jobs"
cmake --build "$work/build" --parallel "$jobs" --target "${tools[@]}" >"$work/build.log" 2>&1 || {
    tail -30 "$work/build.log" >&2; exit 1; }

rm -rf "$dest.tmp"
mkdir -p "$dest.tmp/bin"
for t in "${tools[@]}"; do
    cp "$work/build/bin/$t" "$dest.tmp/bin/"
done
"$dest.tmp/bin/llama-server" --version >"$dest.tmp/version.txt" 2>&1
grep -q "$short" "$dest.tmp/version.txt" || {
    echo "error: the built llama-server reports $(head -1 "$dest.tmp/version.txt"), not $short" >&2; exit 1; }
"$PYTHON" - "$dest.tmp/BUILD.json" <<EOF
import json, sys
json.dump({"llama_cpp_python": "$LLAMA_CPP_PYTHON", "sdist_sha256": "$LLAMA_CPP_SDIST_SHA256",
           "commit": "$LLAMA_CPP_COMMIT", "build_number": $LLAMA_CPP_BUILD,
           "cmake_args": "$LLAMA_CMAKE_ARGS".split(), "tools": "${tools[*]}".split()},
          open(sys.argv[1], "w"), indent=2)
EOF
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "llama.cpp tools: installed in $dest/bin"
