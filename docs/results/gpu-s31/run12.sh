#!/bin/bash
# Session 31: registers_dot with four partial sums instead of one chain of 8·MAXV
# multiply-adds (the prefill up kernel's and the backward's dot products). check-gpu, then
# the previous build (prev: walk_pairs, run11) and this one (new) alternating, two rounds,
# and the training step once each.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell-new && chmod +x /tmp/twell-new
xz -dc -T4 .device/s31/gpu/twell-prev.xz > /tmp/twell-prev && chmod +x /tmp/twell-prev
timeout 200 /tmp/twell-new check-gpu --json $OUT/check.json > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep FAIL $OUT/check.log | head
for round in 1 2; do
  for b in prev new; do
    timeout 100 /tmp/twell-$b bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 1024,2048,16384,65536 \
      --density 0.005,0.01,0.03 --reps 11 --warmup 3 > $OUT/mlp-$b-$round.log 2>&1
    echo "== $b round $round"; grep "2048   5632" $OUT/mlp-$b-$round.log | awk '{print $3, $4, $7, $8, $9}' | tr '\n' ';'; echo
  done
done
