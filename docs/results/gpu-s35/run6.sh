#!/bin/bash
# Session 35: the gate GEMM at 2,048 rows: cuBLAS (plain, the default there) against
# cuBLASLt with the ReLU-mask epilogue picking the fastest of 8 (its default), 32 or 64
# candidates, the layer at 0.5 and 1%, alternating, two rounds; then the candidates'
# times themselves (TWELL_PROFILE prints them when a plan is made).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
R=/tmp/r; mkdir -p $R
B="bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048 --density 0.005,0.01 --reps 15 --warmup 3"
for round in 1 2; do
  for g in plain mask-8 mask-32 mask-64; do
    export TWELL_GATE=${g%%-*}; export TWELL_GATE_CANDIDATES=${g##*-}
    [ $g = plain ] && unset TWELL_GATE_CANDIDATES
    timeout 60 /tmp/twell $B > $R/gate-$g-$round.log 2>&1
    echo "== $g round $round rc $?"; grep -E "^ +2048 +5632" $R/gate-$g-$round.log | awk '{print $4, $7, $8, $9}'
  done
done
for n in 64; do
  TWELL_GATE=mask TWELL_GATE_CANDIDATES=$n TWELL_PROFILE=1 timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 \
    --shape 2048x5632 --tokens 2048,16384 --density 0.005 --reps 3 --warmup 1 --stages > $R/gate-candidates-$n.log 2>&1
  echo "== candidates $n rc $?"; grep -E "candidates|stages" $R/gate-candidates-$n.log | head -8
done
tar -C $R -cJf $OUT/gate-s35.tar.xz .
