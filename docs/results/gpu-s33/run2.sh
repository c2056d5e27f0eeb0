#!/bin/bash
# Session 33: the up kernel as work items (TWELL_UP_ITEMS = parts a row) against the row
# kernel: check-gpu with items of 4 and 1 parts, then two rounds of the bar's 2,048 and
# 16,384 rows at 0.5% and 1%, with the stages, items off / 1 / 2 / 4 / 8 in turn.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s33/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
for p in 4 1; do
  TWELL_UP_ITEMS=$p timeout 150 /tmp/twell check-gpu > $OUT/check-items$p.log 2>&1
  echo "check items $p rc $?"; tail -1 $OUT/check-items$p.log; grep -i "fail\|error" $OUT/check-items$p.log | head -5
done
for round in 1 2; do
  for p in off 1 2 4 8; do
    if [ $p = off ]; then unset TWELL_UP_ITEMS; else export TWELL_UP_ITEMS=$p; fi
    timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384 \
      --density 0.005,0.01 --reps 11 --warmup 3 --stages > $OUT/mlp-items-$p-r$round.log 2>&1
    echo "== round $round items $p"; grep -E "^ +2048 +5632|up|down" $OUT/mlp-items-$p-r$round.log | head -12
  done
done
