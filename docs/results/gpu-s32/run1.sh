#!/bin/bash
# Session 32: the plain gate's pack fused into the prefill row kernels (TWELL_ROW_FUSION
# all = pack + up + down in one kernel, pack-up = pack inside up then the down kernel,
# off = the three kernels). check-gpu under all (twice: the plain gate everywhere, so
# 4,096-131,072 rows take the fused kernel too) and pack-up, then the three forms
# alternating at 512-2,048 rows and, with the plain gate, at 16,384.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s32/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
for mode in all plain pack-up; do
  if [ $mode = plain ]; then env="TWELL_GATE=plain"; else env="TWELL_ROW_FUSION=$mode"; fi
  env $env timeout 150 /tmp/twell check-gpu --json $OUT/check-$mode.json > $OUT/check-$mode.log 2>&1
  echo "check $mode rc $?"; tail -1 $OUT/check-$mode.log; grep -i fail $OUT/check-$mode.log | head
done
for round in 1 2; do
  for mode in off all pack-up; do
    TWELL_ROW_FUSION=$mode timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 512,1024,2048 \
      --density 0.005,0.01,0.03 --reps 11 --warmup 3 > $OUT/mlp-$mode-$round.log 2>&1
    echo "== $mode round $round"; grep "2048   5632" $OUT/mlp-$mode-$round.log | awk '{print $3, $4, $7, $8, $9}' | tr '\n' ';'; echo
  done
done
for mode in off all; do
  TWELL_GATE=plain TWELL_ROW_FUSION=$mode timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 16384 \
    --density 0.005,0.01,0.03 --reps 11 --warmup 3 > $OUT/mlp16k-plain-$mode.log 2>&1
  echo "== plain gate, $mode, 16384"; grep "2048   5632" $OUT/mlp16k-plain-$mode.log | awk '{print $3, $4, $7, $8, $9}' | tr '\n' ';'; echo
done
timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 16384 \
  --density 0.005,0.01,0.03 --reps 11 --warmup 3 > $OUT/mlp16k-mask.log 2>&1
echo "== mask gate (separate), 16384"; grep "2048   5632" $OUT/mlp16k-mask.log | awk '{print $3, $4, $7, $8, $9}' | tr '\n' ';'; echo
