#!/usr/bin/env bash
# The GPU fine-tune behind docs/results.md: a λ sweep of `twell finetune` on the default model
# (SmolLM2-135M-Instruct, ReLU gate), all runs side by side on one GPU, then `twell eval`,
# a generated sample and a dense-vs-TwELL `twell bench model` of every result.
#   scripts/h200-finetune.sh OUTDIR
# Knobs (environment): TWELL (the binary), TWELL_DATA (model + corpus, as scripts/setup.sh
# writes them), RUNS (space-separated DTYPE:LAMBDA:WEIGHT_DECAY[:PENALTY] entries, PENALTY
# plain (default), down-norm, hoyer or gate-l0, see `twell finetune --help`), STEPS, LR, SEQ,
# BATCH, L1_WARMUP (steps of λ's ramp, default STEPS / 4), TARGET (a mean FFN density that steers λ, --l1-target-density; each run's λ is
# then where it starts), ANNEAL (steps over which that target is lowered, --l1-target-anneal), DISTILL (α of --distill: distil from the starting model),
# TIME_LIMIT (seconds: each run stops with a step-N checkpoint; running the same command
# again resumes every run that has no final checkpoint yet), TRAIN_TIMEOUT (seconds, per run), REFERENCE=0 to skip evaluating the original model,
# PARALLEL=1 to run the fine-tunes side by side (each process keeps ~30-45 GB of pool).
set -uo pipefail

out=${1:?usage: h200-finetune.sh OUTDIR}
twell=${TWELL:-twell}
steps=${STEPS:-400}
runs=${RUNS:-"f32:0:0.1 f32:1e-2:0.1 bf16:1e-2:0.1"}
lr=${LR:-2e-4}
seq=${SEQ:-512}
batch=${BATCH:-8}
train_timeout=${TRAIN_TIMEOUT:-0}
mkdir -p "$out"

run_limited() { # run_limited SECONDS CMD...: SECONDS=0 means no limit
  local limit=$1; shift
  if [ "$limit" -gt 0 ]; then timeout "$limit" "$@"; else "$@"; fi
}

if [ "${REFERENCE:-1}" != 0 ]; then
  echo "== reference: the original SiLU model and its untrained ReLU conversion" >&2
  "$twell" eval --device cuda --last 10 --json "$out/eval-silu.json" >"$out/eval-silu.log" 2>&1
  "$twell" eval --device cuda --last 10 --relu --json "$out/eval-relu0.json" \
    >"$out/eval-relu0.log" 2>&1
fi

echo "== fine-tune: {$runs} (dtype:λ:weight decay[:penalty]), $steps steps of $batch x $seq tokens" >&2
names=()
for r in $runs; do
  IFS=: read -r dtype l wd penalty <<<"$r"
  penalty=${penalty:-plain}
  name="$dtype-l1-$l-wd-$wd"
  [ "$penalty" = plain ] || name="$name-$penalty"
  names+=("$name")
  resume=()
  if [ -d "$out/$name/final" ]; then
    echo "$name: finished, skipped" >&2
    continue
  fi
  # The latest step-N checkpoint, if an earlier call stopped at its time limit.
  last=$(ls -d "$out/$name"/step-* 2>/dev/null | sort -V | tail -1)
  [ -n "$last" ] && resume=(--resume "$last")
  # Dense FFN while training: at fine-tuning densities (20-35%) it is the faster path,
  # and the down-norm and hoyer penalties are computed there.
  run_limited "$train_timeout" "$twell" finetune --device cuda --dtype "$dtype" --ffn dense \
    --seq-len "$seq" --batch "$batch" --steps "$steps" --lr "$lr" --warmup 20 \
    --weight-decay "$wd" --l1 "$l" --l1-penalty "$penalty" --l1-warmup "${L1_WARMUP:-$((steps / 4))}" --eval-every 50 \
    ${TARGET:+--l1-target-density "$TARGET"} ${ANNEAL:+--l1-target-anneal "$ANNEAL"} ${DISTILL:+--distill "$DISTILL"} \
    ${TIME_LIMIT:+--time-limit "$TIME_LIMIT"} ${resume[@]+"${resume[@]}"} \
    --eval-batches 8 --out "$out/$name" >>"$out/finetune-$name.log" 2>&1 &
  [ "${PARALLEL:-0}" = 1 ] || wait
done
wait

echo "== eval, sample" >&2
for name in "${names[@]}"; do
  ck="$out/$name/final"
  [ -d "$ck" ] || { echo "no checkpoint for $name" >&2; continue; }
  "$twell" eval --device cuda --model "$ck" --last 10 --json "$out/eval-$name.json" \
    --svg "$out/eval-$name.svg" >"$out/eval-$name.log" 2>&1
  "$twell" generate --device cuda --model "$ck" --ffn sparse --max-tokens 80 \
    -p "Mr. Speaker, Mr. Vice President, members of Congress, my fellow Americans:" \
    >"$out/generate-$name.txt" 2>&1
done
