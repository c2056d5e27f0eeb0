#!/bin/bash
# Session 33: where the item kernel's time goes: the counter (queue) against a fixed
# order without one (static: warp w takes items w, w + W, ...). check-gpu with static
# items of 4 parts, then 2,048 and 16,384 rows at 0.5% with the stages.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s33/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
TWELL_UP_ITEMS=4 TWELL_UP_ITEMS_ORDER=static timeout 150 /tmp/twell check-gpu > $OUT/check-static4.log 2>&1
echo "check static 4 rc $?"; tail -1 $OUT/check-static4.log; grep -i "fail\|error" $OUT/check-static4.log | head -5
for v in off queue-1 static-1 static-4; do
  unset TWELL_UP_ITEMS TWELL_UP_ITEMS_ORDER
  [ $v != off ] && export TWELL_UP_ITEMS_ORDER=${v%-*} TWELL_UP_ITEMS=${v#*-}
  timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384 \
    --density 0.005 --reps 11 --warmup 3 --stages > $OUT/mlp-$v.log 2>&1
  echo "== $v"; grep -E "^ +2048 +5632|up" $OUT/mlp-$v.log | head -6
done
