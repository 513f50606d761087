# Shared steps of the device jobs (bench/h200_moe.sh, bench/h200x2.sh), sourced by them; REPO must be set.
# The device machine has no network and takes at most 64 MiB per call: wheels travel as git-ignored part folders
# (.vwNN: vLLM, ../shared/device/vllm; .twNN: ModelOpt, scripts/trt_env.sh; .whl-llmc: llm-compressor), and a job
# runs from a snapshot of the repository because every call re-sends the working tree.

install_llmc() {  # llm-compressor and its pins into /tmp/site-llmc, apart from vLLM's compressed-tensors
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-llmc "$REPO"/.whl-llmc/*.whl
}

take_vllm_parts() {  # move the carried vLLM part(s) out of the tree before the next call replaces it
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
