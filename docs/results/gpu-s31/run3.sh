#!/bin/bash
# Session 31: the column down kernel with the lists of 32 tokens interleaved (one 512-byte
# run per warp load) and the next entries loaded ahead: check-gpu, then --stages for both
# down kernels at M = 2048 and 16384, and ncu on the column kernel at 1%.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 200 /tmp/twell check-gpu > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep -E "FAIL|down kernels" $OUT/check.log | head -20
for k in rows cols rows cols; do
  TWELL_DOWN=$k timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
    --tokens 2048,16384 --density 0.005,0.01,0.03 --reps 7 --warmup 2 --stages > $OUT/stages-$k.log 2>&1
  echo "== $k"; grep -i "stage\|2048   5632" $OUT/stages-$k.log | head -12
done
TWELL_DOWN=cols timeout 150 ncu --clock-control none -k 'regex:gated_t2d_cols' -c 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
  /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 16384 --density 0.01 --reps 1 --warmup 0 > $OUT/ncu-cols.log 2>&1
echo "== ncu rc $?"; grep -E "gated_t2d|Duration|Throughput|Issued Warp|Bank|Wavefronts" $OUT/ncu-cols.log | head -40
