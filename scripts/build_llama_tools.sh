#!/usr/bin/env bash
# Build llama.cpp once from the source llama-cpp-python vendors: its shared libraries (libllama, libggml*, libmtmd)
# and command-line tools (llama-imatrix, llama-quantize, llama-perplexity, llama-server), plus llama-cpp-python's
# wheel without a llama.cpp of its own, so the Python library and the tools run the very same .so files.
#
#   scripts/build_llama_tools.sh DEST
#
# Environment (set by the Makefile): PYTHON (a Python with pip), LLAMA_CPP_PYTHON (the pinned llama-cpp-python
# version), LLAMA_CPP_SDIST_SHA256 (its sdist's sha256), LLAMA_CPP_COMMIT and LLAMA_CPP_BUILD (the llama.cpp
# commit and build number that sdist vendors), LLAMA_CMAKE_ARGS (the CPU flags), JOBS.
#
# DEST gets bin/ (the tools), lib/ (the shared libraries, which `make install` links as the package's
# llama_cpp/lib, where llama-cpp-python loads them from), wheel/ (llama-cpp-python built with -DLLAMA_BUILD=OFF:
# Python only) and BUILD.json. The tools find lib/ through their RPATH ($ORIGIN/../lib, resolved through the
# venv's links), the libraries each other through $ORIGIN. The sdist is checked against its pinned sha256, and its
# CHANGELOG must name the pinned commit. An sdist has no git history, so llama.cpp's build would stamp
# "0 (unknown)": the commit and build number are passed in, and the tools' --version reports them. Everything lands
# in DEST.tmp and is renamed to DEST only when complete, so an interrupted build never looks finished.
set -euo pipefail

dest=${1:?usage: build_llama_tools.sh DEST}
: "${PYTHON:?}" "${LLAMA_CPP_PYTHON:?}" "${LLAMA_CPP_SDIST_SHA256:?}" "${LLAMA_CPP_COMMIT:?}" "${LLAMA_CPP_BUILD:?}"
: "${LLAMA_CMAKE_ARGS:?}"
jobs=${JOBS:-2}
tools=(llama-imatrix llama-quantize llama-perplexity llama-server)
# What llama-cpp-python loads (llama_cpp.py, _ggml.py, mtmd_cpp.py); the tools pull in the rest they link.
libs=(llama ggml mtmd)
short=${LLAMA_CPP_COMMIT:0:9}

work=$(mktemp -d "${TMPDIR:-/tmp}/quantkit-llama-tools.XXXXXX")
trap 'rm -rf "$work" "$dest.tmp"' EXIT

echo "llama.cpp: downloading the llama-cpp-python $LLAMA_CPP_PYTHON sdist"
"$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON"
sdist="$work/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz"
echo "$LLAMA_CPP_SDIST_SHA256  $sdist" | sha256sum --quiet -c - || {
    echo "error: $sdist does not have the pinned sha256 $LLAMA_CPP_SDIST_SHA256" >&2; exit 1; }
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$LLAMA_CPP_PYTHON"
# The changelog's entry for this version names the llama.cpp commit it vendors.
sed -n "/^## \[$LLAMA_CPP_PYTHON\]/,/^## \[/p" "$src/CHANGELOG.md" | grep -q "llama.cpp@$short" || {
    echo "error: llama-cpp-python $LLAMA_CPP_PYTHON's CHANGELOG does not name llama.cpp@$short" >&2; exit 1; }

# Shared libraries, Release, no tests or examples; no web UI (it would be downloaded), no OpenSSL. The install
# RPATH is used in the build tree too (the tools and libraries sit together in build/bin there).
# shellcheck disable=SC2086 # LLAMA_CMAKE_ARGS is a list of -D flags
cmake -S "$src/vendor/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release $LLAMA_CMAKE_ARGS \
    -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN:$ORIGIN/../lib' \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_NUMBER="$LLAMA_CPP_BUILD" -DLLAMA_BUILD_COMMIT="$short" >"$work/configure.log" 2>&1 || {
    tail -30 "$work/configure.log" >&2; exit 1; }
echo "llama.cpp: compiling ${libs[*]} ${tools[*]} (b$LLAMA_CPP_BUILD, $short) with $jobs jobs"
cmake --build "$work/build" --parallel "$jobs" --target "${libs[@]}" "${tools[@]}" >"$work/build.log" 2>&1 || {
    tail -30 "$work/build.log" >&2; exit 1; }

# llama-cpp-python itself: LLAMA_BUILD=OFF leaves its CMake nothing to compile or install, so the wheel is Python.
echo "llama.cpp: building the llama-cpp-python $LLAMA_CPP_PYTHON wheel without its own llama.cpp"
CMAKE_ARGS="-DLLAMA_BUILD=OFF" "$PYTHON" -m pip wheel -q --no-deps --no-cache-dir -w "$work/wheel" "$src" \
    >"$work/wheel.log" 2>&1 || { tail -30 "$work/wheel.log" >&2; exit 1; }

rm -rf "$dest.tmp"
mkdir -p "$dest.tmp/bin" "$dest.tmp/lib"
for t in "${tools[@]}"; do
    cp "$work/build/bin/$t" "$dest.tmp/bin/"
done
cp -P "$work/build/bin/"lib*.so* "$dest.tmp/lib/"
cp -r "$work/wheel" "$dest.tmp/"
"$dest.tmp/bin/llama-server" --version >"$dest.tmp/version.txt" 2>&1
grep -q "$short" "$dest.tmp/version.txt" || {
    echo "error: the built llama-server reports $(head -1 "$dest.tmp/version.txt"), not $short" >&2; exit 1; }
"$PYTHON" - "$dest.tmp/BUILD.json" <<PY
import json, sys
json.dump({"llama_cpp_python": "$LLAMA_CPP_PYTHON", "sdist_sha256": "$LLAMA_CPP_SDIST_SHA256",
           "commit": "$LLAMA_CPP_COMMIT", "build_number": $LLAMA_CPP_BUILD,
           "cmake_args": "$LLAMA_CMAKE_ARGS".split(), "tools": "${tools[*]}".split(), "libraries": "lib",
           "wheel": "wheel/$(basename "$work"/wheel/*.whl)"},
          open(sys.argv[1], "w"), indent=2)
PY
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "llama.cpp: tools in $dest/bin, libraries in $dest/lib, llama-cpp-python's wheel in $dest/wheel"
