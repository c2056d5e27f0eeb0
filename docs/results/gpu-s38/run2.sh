#!/usr/bin/env bash
# Session 38, the lower-priority rest (after run1.sh; carry .device/s38/d):
#   - `TWELL_GATE=lt` (session 37): the plain gate through cuBLASLt's fastest timed
#     candidate instead of `cublasGemmEx`'s first choice; `check-gpu` with it, then the
#     MLP with and without it (and with the mask rows, whose sign kernel then reads it);
#   - the masked gate GEMM from 8 (the default) and 32 timed candidates, with the mask
#     rows, where the GEMM is most of what is left at 16,384 and 65,536 rows.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
. "$(dirname "$0")/lib.sh"
[ -x /tmp/twell-new ] || { xz -dc -T8 .device/s38/d/twell.xz > /tmp/twell-new && chmod +x /tmp/twell-new; }
check lt --mlp-only TWELL_GATE=lt
# mlp NAME EXTRA [KNOB=VALUE...]: the MLP bench on the new build, its table's rows printed.
mlp() {
  local name=$1 extra=$2
  shift 2
  env "$@" timeout 120 /tmp/twell-new bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
    --density 0.005,0.01 --reps 15 --warmup 3 $extra > "$OUT/$name.log" 2>&1
  stamp "== $name (rc $?): M target dense sparse speedup auto"
  grep -E "^ +2048 +5632" "$OUT/$name.log" | awk '{print $3, $4, $7, $8, $9, $10}'
}
for round in 1 2; do
  mlp default-$round "--tokens 2048,4096"
  mlp lt-$round "--tokens 2048,4096" TWELL_GATE=lt
  mlp lt-mask-rows-$round "--tokens 2048,4096" TWELL_GATE=lt TWELL_MASK_ROWS=on
done
for n in 8 32; do
  mlp mask-rows-candidates-$n "--tokens 16384,65536" TWELL_MASK_ROWS=on TWELL_GATE_CANDIDATES=$n
done
stamp "done"
