#!/bin/bash
# The union kernels (twell_mlp_union.cu, TWELL_PREFILL=union), written in the thirty-fourth
# session without a device: check-gpu on the default path (the attention's mma helpers moved
# to mma_sync.cuh) and on the union path at both block widths, then the prefill MLP at 2,048
# and 16,384 rows with the stages: the row kernels and the union kernels in turn, twice.
# BIN: the xz'd release binary carried to the device (default .device/gpu/twell.xz).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 "${BIN:-.device/gpu/twell.xz}" > /tmp/twell && chmod +x /tmp/twell
timeout 150 /tmp/twell check-gpu --json $OUT/check.json > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep -i "fail\|error" $OUT/check.log | head -5
for nb in 256 128; do
  TWELL_PREFILL=union TWELL_UNION_BLOCK=$nb timeout 150 /tmp/twell check-gpu \
    > $OUT/check-union-$nb.log 2>&1
  echo "check union $nb rc $?"; tail -1 $OUT/check-union-$nb.log
  grep -i "fail\|error" $OUT/check-union-$nb.log | head -5
done
for round in 1 2; do
  for path in rows union-256 union-128; do
    export TWELL_PREFILL=${path%%-*} TWELL_UNION_BLOCK=${path##*-}
    [ "$path" = rows ] && unset TWELL_UNION_BLOCK
    timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
      --tokens 2048,16384 --density 0.005,0.01,0.03 --reps 11 --warmup 3 --stages \
      > $OUT/mlp-$path-$round.log 2>&1
    echo "== $path round $round rc $?"; grep -E "^ +(2048|16384) +|up|down" $OUT/mlp-$path-$round.log | head -14
  done
done
