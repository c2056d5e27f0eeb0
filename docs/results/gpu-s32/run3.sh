#!/bin/bash
# Session 32: after the review mend (walk_pairs shuffles from lane `at`, not `at & 31`; the
# row split's wave from the driver's occupancy of the up kernel instead of a constant 16
# warps an SM): check-gpu, then the prefill sizes where the split rule decides
# (TWELL_ROW_SPLIT unset against 4, 2 and 1 fixed).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s32/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 150 /tmp/twell check-gpu --json $OUT/check.json > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep -i "fail\|error" $OUT/check.log | head
for split in auto 4 2 1; do
  if [ $split = auto ]; then unset TWELL_ROW_SPLIT; else export TWELL_ROW_SPLIT=$split; fi
  timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 512,1024,2048 \
    --density 0.005 --reps 11 --warmup 3 > $OUT/mlp-split-$split.log 2>&1
  echo "== split $split"; grep "2048   5632" $OUT/mlp-split-$split.log | awk '{print $3, $4, $7, $8, $9}' | tr '\n' ';'; echo
done
