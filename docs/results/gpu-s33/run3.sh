#!/bin/bash
# Session 33: the item kernel bounded to two blocks an SM (__launch_bounds__(256, 2)):
# check-gpu with items of 4 parts, then 2,048 and 16,384 rows at 0.5% with the stages,
# items off / 1 / 4, two rounds.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s33/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
TWELL_UP_ITEMS=4 timeout 150 /tmp/twell check-gpu > $OUT/check-items4.log 2>&1
echo "check items 4 rc $?"; tail -1 $OUT/check-items4.log; grep -i "fail\|error" $OUT/check-items4.log | head -5
for round in 1 2; do
  for p in off 1 4; do
    if [ $p = off ]; then unset TWELL_UP_ITEMS; else export TWELL_UP_ITEMS=$p; fi
    timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384 \
      --density 0.005 --reps 11 --warmup 3 --stages > $OUT/mlp-items-$p-r$round.log 2>&1
    echo "== round $round items $p"; grep -E "^ +2048 +5632|up" $OUT/mlp-items-$p-r$round.log | head -6
  done
done
