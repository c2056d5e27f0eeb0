#!/bin/bash
# Session 31, the final build (walk_pairs; two warps a row from 529 to 1,056 tokens):
# check-gpu, then the session's starting build (old) against it from 128 to 2,048 tokens,
# two rounds, and the bar sizes once more.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
xz -dc -T4 .device/s31/gpu/twell-old.xz > /tmp/twell-old && chmod +x /tmp/twell-old
timeout 200 /tmp/twell check-gpu --json $OUT/check.json > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep FAIL $OUT/check.log | head
for round in 1 2; do
  for b in old new; do
    t=/tmp/twell; [ $b = old ] && t=/tmp/twell-old
    timeout 100 $t bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 128,512,768,1024,2048 \
      --density 0.005,0.01,0.03 --reps 11 --warmup 3 > $OUT/mid-$b-$round.log 2>&1
    echo "== $b round $round"; grep "2048   5632" $OUT/mid-$b-$round.log | awk '{print $3, $4, $7, $8, $9}' | tr '\n' ';'; echo
  done
done
timeout 150 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 1,2048,16384,65536 \
  --density 0.005,0.01,0.03 --reps 15 --warmup 3 --json $OUT/mlp.json > $OUT/mlp.log 2>&1
echo "mlp rc $?"; grep "2048   5632" $OUT/mlp.log
