#!/usr/bin/env bash
# Session 36: glibc's malloc policy (`twell::cpu::host_memory`) on and off in one build,
# alternating: a CPU fine-tuning run of the default model (tokens/s of steps 2-8, the
# first step includes warm-up), peak RSS, and the CPU MLP bench. TWELL = the release
# binary; off = TWELL_NO_MALLOC_TUNING=1.
set -u
T=${TWELL:-target/release/twell}
R=$(mktemp -d)
for round in 1 2; do
  for v in off on; do
    if [ $v = off ]; then export TWELL_NO_MALLOC_TUNING=1; else unset TWELL_NO_MALLOC_TUNING; fi
    /usr/bin/time -f "$v round $round: %e s wall, %S s system, %U s user, peak RSS %M KiB" \
      $T finetune --dtype f32 --seq-len 256 --batch 2 --steps 8 --eval-every 0 --eval-batches 1 \
      --l1 1e-2 --max-train-tokens 20000 --out $R/$v$round 2>&1 >/dev/null | tail -1
    python3 -c "
import json, statistics
t = [json.loads(l)['tokens_per_sec'] for l in open('$R/$v$round/train_log.jsonl')]
print('$v round $round: tokens/s per step', [round(x, 1) for x in t], 'median of steps 2-8', round(statistics.median(t[1:]), 1))"
  done
done
for v in off on; do
  if [ $v = off ]; then export TWELL_NO_MALLOC_TUNING=1; else unset TWELL_NO_MALLOC_TUNING; fi
  echo "== bench mlp, policy $v"
  $T bench mlp --shape 2048x5632 --tokens 1,16,512 --density 0.01,0.03 --reps 11 --warmup 2 2>&1 | tail -7
done
rm -rf $R
