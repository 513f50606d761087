#!/usr/bin/env bash
# FP4 defaults by measurement (issue 40): every NVFP4/MXFP4 W4A16 algorithm x observer on SmolLM2-135M-Instruct,
# made by the quantkit verbs on this CPU, one after another, then scored by one `quantkit eval` (transformers, CPU,
# exact KLD against the bf16 model on the same held-out tokens). Artifacts go under $WORK (kept, reused if present).
#     bash bench/results/fp4_cpu/run.sh            # build what is missing, then score everything built (eval.json)
# The 2026-12-04 run built in several of these at once (ONLY_BUILD=1, VARIANTS=...) and scored in six evals as
# artifacts were finished (eval1.json ... ): commands.log lists every command.
#     ONLY_BUILD=1 bash bench/results/fp4_cpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODEL=${MODEL:-models/real/SmolLM2-135M-Instruct}
WORK=${WORK:-$HOME/.cache/quantkit/bench/fp4_cpu}
SAMPLES=${SAMPLES:-16} SEQ_LEN=${SEQ_LEN:-512} TOKENS=${TOKENS:-4096} CTX=${CTX:-2048}
OUT=bench/results/fp4_cpu
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1
PY=${PY:-.venv/bin/python}
mkdir -p "$WORK"
VARIANTS=${VARIANTS:-"nvfp4:rtn:minmax nvfp4:rtn:mse mxfp4:rtn:minmax mxfp4:rtn:mse nvfp4:gptq:mse nvfp4:awq:minmax
  nvfp4:gptq:minmax nvfp4:awq:mse mxfp4:gptq:mse mxfp4:awq:minmax mxfp4:gptq:minmax mxfp4:awq:mse"}
for v in $VARIANTS; do
  IFS=: read -r verb algo obs <<<"$v"
  name="$verb-w4a16-$algo-$obs"
  [ -f "$WORK/$name/quantkit.json" ] && continue
  args=("$verb" "$MODEL" "$WORK/$name" --scheme w4a16 --algorithm "$algo" --observer "$obs" --force)
  [ "$algo" = rtn ] || args+=(--samples "$SAMPLES" --seq-len "$SEQ_LEN")
  echo "== $(date -u +%H:%M:%S) quantkit ${args[*]}" | tee -a "$WORK/commands.log"
  start=$(date +%s)
  "$PY" -m quantkit "${args[@]}" --json > "$WORK/$name.json"
  echo "$name $(( $(date +%s) - start ))" >> "$WORK/times.txt"
done
[ -n "${ONLY_BUILD:-}" ] && exit 0
built=()
for v in $VARIANTS; do IFS=: read -r verb algo obs <<<"$v"; d="$WORK/$verb-w4a16-$algo-$obs"; [ -f "$d/quantkit.json" ] && built+=("$d"); done
eval_args=(eval "${built[@]}" --baseline "$MODEL" --dataset heldout --max-tokens "$TOKENS" --ctx "$CTX" --device cpu
  --report-dir "$WORK/eval" --max-ppl-ratio 100 --max-kld 100 --min-top1 0)
echo "== $(date -u +%H:%M:%S) quantkit ${eval_args[*]}" | tee -a "$WORK/commands.log"
"$PY" -m quantkit "${eval_args[@]}" --json > "$OUT/eval.json"
cp "$WORK/times.txt" "$OUT/quantize_times.txt"
