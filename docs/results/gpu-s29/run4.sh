#!/bin/bash
# Call 4 (session 29): the 28-layer model's prefill at 3% FFN density, candle's dense MLP,
# the TwELL kernels and `Auto` (the products path there) in one process, with energy.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s29/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 400 /tmp/twell bench model --device cuda --dtype bf16 --shape 2048x5632x28 --heads 32 --vocab 49152 \
  --density 0.03 --prefill 16x2048 --decode-batch 1 --decode-steps 8 --train "" --reps 3 --warmup 1 \
  --energy-secs 5 --ffn-paths dense,sparse,auto --json $OUT/model-3pct.json > $OUT/model-3pct.log 2>&1
echo "model rc $?"; cat $OUT/model-3pct.log
