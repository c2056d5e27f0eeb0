#!/bin/bash
# Call 3 (session 29): check-gpu on the final build (the products path's GEMMs through the
# shared `x_times_wt`, the counts through one helper), and the bar densities once more.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s29/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 150 /tmp/twell check-gpu --json $OUT/check-final.json > $OUT/check-final.log 2>&1
echo "check rc $?"; tail -1 $OUT/check-final.log; grep FAIL $OUT/check-final.log | head; grep 'auto above' $OUT/check-final.log
timeout 200 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384,65536 \
  --density 0.005,0.01,0.03 --reps 15 --warmup 3 --json $OUT/mlp-final.json > $OUT/mlp-final.log 2>&1
echo "mlp rc $?"; cat $OUT/mlp-final.log
