#!/usr/bin/env bash
# Session 38 (for the next device, after run1.sh; carry .device/s38/d). `TWELL_MASK_ROWS=on`:
# where the gate GEMM wrote its ReLU bit mask (the default from 4,096 rows), the up and
# down row kernels walk each row's mask (`walk_mask_row`, `kernels/twell_common.cuh`) and
# leave h in the gate, so the pack launch goes (45 µs at 16,384 rows, 150 at 65,536).
# Checks two ways (the mask and a warp a row forced at every prefill size, so 65 to 2,048
# rows take the new kernels too; and at the default sizes with the overlap), then the MLP
# unprofiled at 4,096 / 16,384 / 65,536 rows, off / on / on+overlap alternating, two rounds,
# then the stages once each way.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
. "$(dirname "$0")/lib.sh"
[ -x /tmp/twell-new ] || { xz -dc -T8 .device/s38/d/twell.xz > /tmp/twell-new && chmod +x /tmp/twell-new; }
check mask-rows-everywhere TWELL_MASK_ROWS=on TWELL_GATE=mask TWELL_ROW_SPLIT=1
check mask-rows-overlap TWELL_MASK_ROWS=on TWELL_OVERLAP=on
# bench EXTRA KNOB=VALUE...: the MLP bench with the knobs set, EXTRA ("" or --stages) added.
bench() {
  local extra=$1
  shift
  env "$@" timeout 120 /tmp/twell-new bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
    --tokens 4096,16384,65536 --density 0.005,0.01 --reps 15 --warmup 3 $extra
}
for round in 1 2; do
  for v in off on on-overlap; do
    knobs=(TWELL_MASK_ROWS=on)
    [ $v = off ] && knobs=(TWELL_MASK_ROWS=off)
    [ $v = on-overlap ] && knobs+=(TWELL_OVERLAP=on)
    log="$OUT/mlp-mask-rows-$v-$round.log"
    bench "" "${knobs[@]}" > "$log" 2>&1
    stamp "== mask rows $v, round $round (rc $?): M target dense sparse speedup auto"
    grep -E "^ +2048 +5632" "$log" | awk '{print $3, $4, $7, $8, $9, $10}'
  done
done
for v in off on; do
  log="$OUT/stages-mask-rows-$v.log"
  bench --stages TWELL_MASK_ROWS=$v > "$log" 2>&1
  stamp "== stages, mask rows $v (rc $?)"
  grep -E "stages|^ +2048 +5632" "$log" | head -12
done
# The masked gate GEMM from 8 (the default) and 32 timed cuBLASLt candidates, with the mask
# rows (the pack gone, the GEMM is most of what is left at these sizes).
for n in 8 32; do
  log="$OUT/mlp-mask-rows-candidates-$n.log"
  bench "" TWELL_MASK_ROWS=on TWELL_GATE_CANDIDATES=$n > "$log" 2>&1
  stamp "== mask rows, gate from $n candidates (rc $?)"
  grep -E "^ +2048 +5632" "$log" | awk '{print $3, $4, $7, $8, $9, $10}'
done
