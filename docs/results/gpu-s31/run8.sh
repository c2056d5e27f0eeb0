#!/bin/bash
# Session 31: with `walk_pairs`, the row split again at 2,048-4,096 rows (two warps a row
# now instantiated): TWELL_ROW_SPLIT=1, 2, 4 in turn, two rounds, --stages off.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
for round in 1 2; do
  for s in 1 2 4; do
    TWELL_ROW_SPLIT=$s timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
      --tokens 1024,2048,3072,4096 --density 0.005,0.01 --reps 11 --warmup 3 > $OUT/split$s-$round.log 2>&1
    echo "== split $s round $round"; grep "2048   5632" $OUT/split$s-$round.log | awk '{print $3, $4, $7, $8, $9}' | tr '\n' ';'; echo
  done
done
