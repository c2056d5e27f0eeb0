#!/bin/bash
# Session 35: the vector pack with fewer instructions (one division a warp, loads issued
# together, a cheaper positive mask, a ballot rank when no lane holds two positives):
# check-gpu on the new build, then old (.device/gpu) against new (.device/newpack) at
# 2,048 rows with and without the stages, alternating, two rounds; 16,384 rows on the
# plain gate (TWELL_GATE=plain) too, where the vector pack then runs.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/gpu/twell.xz > /tmp/old && xz -dc -T4 .device/newpack/twell.xz > /tmp/new && chmod +x /tmp/old /tmp/new
R=/tmp/r; mkdir -p $R
timeout 150 /tmp/new check-gpu > $R/check-new.log 2>&1
echo "check new rc $?"; tail -1 $R/check-new.log; grep FAIL $R/check-new.log | head -3
for round in 1 2; do
  for b in old new; do
    timeout 60 /tmp/$b bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048 \
      --density 0.005,0.01,0.03 --reps 15 --warmup 3 > $R/mlp-$b-$round.log 2>&1
    echo "== $b round $round"; grep -E "^ +2048 +5632" $R/mlp-$b-$round.log | awk '{print $4, $7, $8, $9, $10}'
    timeout 60 /tmp/$b bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048 \
      --density 0.005,0.01,0.03 --reps 11 --warmup 3 --stages > $R/stages-$b-$round.log 2>&1
    grep stages $R/stages-$b-$round.log
    TWELL_GATE=plain timeout 60 /tmp/$b bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 16384 \
      --density 0.005,0.01 --reps 7 --warmup 2 --stages > $R/plain16k-$b-$round.log 2>&1
    grep stages $R/plain16k-$b-$round.log
  done
done
tar -C $R -cJf $OUT/pack-s35.tar.xz .
