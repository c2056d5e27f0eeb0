#!/bin/bash
# Call 2 (session 25): keep part b of the default GGUF, then the 28-layer prefill with the
# mask packs named as arguments (TWELL_MASK_PACK), one process each, in the order given.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
cp .device/s25/b/gguf.part-b /tmp/assets/
T=/tmp/twell; R=/tmp/r2; mkdir -p $R
MODEL="--device cuda --dtype bf16 --shape 2048x5632x28 --heads 32 --vocab 49152 --density 0.005"
i=0; for p in "$@"; do i=$((i+1))
  TWELL_MASK_PACK=$p timeout 150 $T bench model $MODEL --prefill 4x2048,16x2048,64x2048 --decode-batch 1 --decode-steps 8 --train "" --reps 3 --warmup 1 --energy-secs 10 > $R/model-$i-$p.log 2>&1
  echo "== $p rc $?"; grep -E "prefill" $R/model-$i-$p.log
done
tar cJf $OUT/call2.tar.xz -C $R .
