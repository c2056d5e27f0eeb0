#!/bin/bash
# Call 2 (session 29): the MLP forward with `Auto`'s break-even at 1.1% on prefill sizes,
# around it and at the bar densities, with each variant's peak extra memory; then the
# same MLP in eager PyTorch on the same card (`bench/torch_mlp.py`).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s29/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 200 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384,65536 \
  --density 0.005,0.01,0.011,0.012,0.03 --reps 15 --warmup 3 --json $OUT/mlp-auto.json > $OUT/mlp-auto.log 2>&1
echo "mlp rc $?"; cat $OUT/mlp-auto.log
timeout 120 python3 bench/torch_mlp.py --tokens 1,2048,16384,65536 --json $OUT/torch-dense.json > $OUT/torch-dense.log 2>&1
echo "torch rc $?"; cat $OUT/torch-dense.log
