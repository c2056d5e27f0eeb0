#!/bin/bash
# Session 31: the row split at 2,048-4,096 rows. The rule takes four warps a row only
# while they fit one wave (up to ~1,056 rows); TWELL_ROW_SPLIT=4 against =1 on this build
# (the column kernel reverted), --stages, two rounds.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
for round in 1 2; do
  for s in 1 4; do
    TWELL_ROW_SPLIT=$s timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
      --tokens 2048,3072,4096 --density 0.005,0.01 --reps 9 --warmup 2 --stages > $OUT/split$s-$round.log 2>&1
    echo "== split $s round $round"; grep -i "stage\|2048   5632" $OUT/split$s-$round.log | head -12
  done
done
