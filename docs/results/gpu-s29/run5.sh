#!/bin/bash
# Call 5 (session 29): where the TwELL kernels' time goes at the M = 2048 bar (stages by
# CUDA events), with the plain gate (the default below 4,096 rows) and the ReLU-mask gate.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s29/twell.xz > /tmp/twell && chmod +x /tmp/twell
for gate in plain mask; do
  echo "== TWELL_GATE=$gate"
  TWELL_GATE=$gate timeout 120 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,4096 \
    --density 0.005,0.01 --reps 15 --warmup 3 --stages 2>&1 | grep -v '^\s*$'
done > $OUT/stages-2048.log
echo rc $?; cat $OUT/stages-2048.log
