#!/bin/bash
# Session 35: the vector pack asking L2 for the up rows of w_ud while it reads the gate
# (TWELL_PACK_WARM=up), against off: check-gpu both ways, then the stages at 2,048 and
# 16,384 rows (the vector pack runs below 4,096 rows, or with TWELL_GATE=plain), 0.5 / 1%.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
R=/tmp/r; mkdir -p $R
for w in off up; do
  TWELL_PACK_WARM=$w timeout 150 /tmp/twell check-gpu > $R/check-warm-$w.log 2>&1
  echo "check warm $w rc $?"; tail -1 $R/check-warm-$w.log; grep FAIL $R/check-warm-$w.log | head -3
done
for round in 1 2; do
  for w in off up; do
    TWELL_PACK_WARM=$w timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
      --tokens 2048 --density 0.005,0.01 --reps 15 --warmup 3 > $R/mlp-warm-$w-$round.log 2>&1
    echo "== warm $w round $round"; grep -E "^ +2048 +5632" $R/mlp-warm-$w-$round.log | awk '{print $4, $7, $8, $9}'
    TWELL_PACK_WARM=$w timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
      --tokens 2048 --density 0.005,0.01 --reps 11 --warmup 3 --stages > $R/stages-warm-$w-$round.log 2>&1
    grep stages $R/stages-warm-$w-$round.log
  done
done
tar -C $R -cJf $OUT/warm-s35.tar.xz .
