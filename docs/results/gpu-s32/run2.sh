#!/bin/bash
# Session 32: run1 again after the fused kernel opts in to more than 48 KB of shared
# memory at four warps a row (its launch failed at 65 and 512 rows): check-gpu with the
# fused kernels (plain gate everywhere), then the three forms alternating at 512-2,048 rows.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s32/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
TWELL_GATE=plain timeout 150 /tmp/twell check-gpu --json $OUT/check-plain.json > $OUT/check-plain.log 2>&1
echo "check plain rc $?"; tail -1 $OUT/check-plain.log; grep -i "fail\|error" $OUT/check-plain.log | head
for round in 1 2; do
  for mode in off all pack-up; do
    TWELL_ROW_FUSION=$mode timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 512,1024,2048 \
      --density 0.005,0.01,0.03 --reps 11 --warmup 3 > $OUT/mlp-$mode-$round.log 2>&1
    echo "== $mode round $round"; grep "2048   5632" $OUT/mlp-$mode-$round.log | awk '{print $3, $4, $7, $8, $9}' | tr '\n' ';'; echo
  done
done
