#!/bin/bash
# Session 31: two warps a row against four (and one) below 1,024 rows, with `walk_pairs`:
# TWELL_ROW_SPLIT=1, 2, 4 in turn, two rounds.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
for round in 1 2; do
  for s in 1 2 4; do
    TWELL_ROW_SPLIT=$s timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
      --tokens 128,256,512,768,1024,1536 --density 0.005,0.01,0.03 --reps 11 --warmup 3 > $OUT/split$s-$round.log 2>&1
    echo "== split $s round $round"; grep "2048   5632" $OUT/split$s-$round.log | awk '{print $3, $4, $8}' | tr '\n' ';'; echo
  done
done
