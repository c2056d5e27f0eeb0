#!/bin/bash
# Session 33: registers_dot issues a neuron row's loads before its multiply-adds (the item
# kernel had compiled them one behind another): check-gpu on the default path and with
# items of 4 parts, then 2,048 and 16,384 rows at 0.5% and 1% with the stages: the row
# kernel (off) against items of 1 and 4 parts.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s33/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 40 /tmp/twell check-gpu > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep -i "fail\|error" $OUT/check.log | head -5
TWELL_UP_ITEMS=4 timeout 40 /tmp/twell check-gpu > $OUT/check-items4.log 2>&1
echo "check items 4 rc $?"; tail -1 $OUT/check-items4.log; grep -i "fail\|error" $OUT/check-items4.log | head -5
for p in off 4 1; do
  if [ $p = off ]; then unset TWELL_UP_ITEMS; else export TWELL_UP_ITEMS=$p; fi
  timeout 25 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384 \
    --density 0.005,0.01 --reps 11 --warmup 3 --stages > $OUT/mlp-items-$p.log 2>&1
  echo "== items $p"; grep -E "^ +2048 +5632|up" $OUT/mlp-items-$p.log | head -8
done
