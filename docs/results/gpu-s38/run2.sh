#!/usr/bin/env bash
# Session 38 (for the next device, after run1.sh; carry .device/s38/d). `TWELL_MASK_ROWS=on`:
# the up and down row kernels walk a bit mask of each row (`walk_mask_row`,
# `kernels/twell_common.cuh`) and leave h in the gate, instead of TwELL slots. From 4,096
# rows the mask is cuBLASLt's and the pack launch goes (45 µs at 16,384 rows, 150 at
# 65,536); below, a sign kernel makes it from the plain gate in place of the pack (11.5 µs
# at 2,048 rows, bound by its ranking and slot writes).
# Checks three ways, a warp a row forced in the first two so that 65 to 1,024 rows take the
# new kernels too: cuBLASLt's mask at every prefill size; the sign kernel's at every
# prefill size; the default sizes with the overlap. Then the MLP unprofiled at 2,048 / 4,096 / 16,384 /
# 65,536 rows, off / on / on+overlap alternating, two rounds; eight layers a call at 2,048
# rows the same three ways; the stages once each way; the masked gate from 8 and 32
# candidates.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
. "$(dirname "$0")/lib.sh"
[ -x /tmp/twell-new ] || { xz -dc -T8 .device/s38/d/twell.xz > /tmp/twell-new && chmod +x /tmp/twell-new; }
check mask-rows-lt-mask TWELL_MASK_ROWS=on TWELL_GATE=mask TWELL_ROW_SPLIT=1
check mask-rows-sign-mask TWELL_MASK_ROWS=on TWELL_GATE=plain TWELL_ROW_SPLIT=1
check mask-rows-overlap TWELL_MASK_ROWS=on TWELL_OVERLAP=on
# bench EXTRA KNOB=VALUE...: the MLP bench with the knobs set, EXTRA (more bench flags) added.
bench() {
  local extra=$1
  shift
  env "$@" timeout 120 /tmp/twell-new bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
    --density 0.005,0.01 --reps 15 --warmup 3 $extra
}
# ab NAME EXTRA: off / on / on+overlap alternating, two rounds.
ab() {
  local name=$1 extra=$2
  for round in 1 2; do
    for v in off on on-overlap; do
      knobs=(TWELL_MASK_ROWS=on)
      [ $v = off ] && knobs=(TWELL_MASK_ROWS=off)
      [ $v = on-overlap ] && knobs+=(TWELL_OVERLAP=on)
      log="$OUT/$name-$v-$round.log"
      bench "$extra" "${knobs[@]}" > "$log" 2>&1
      stamp "== $name, mask rows $v, round $round (rc $?): M target dense sparse speedup auto"
      grep -E "^ +2048 +5632" "$log" | awk '{print $3, $4, $7, $8, $9, $10}'
    done
  done
}
ab mlp "--tokens 2048,4096,16384,65536"
ab chain8 "--tokens 2048 --chain 8 --weight-sets 8"
for v in off on; do
  log="$OUT/stages-mask-rows-$v.log"
  bench "--tokens 2048,16384 --stages" TWELL_MASK_ROWS=$v > "$log" 2>&1
  stamp "== stages, mask rows $v (rc $?)"
  grep -E "stages|^ +2048 +5632" "$log" | head -12
done
# The masked gate from 8 (the default) and 32 timed cuBLASLt candidates, with the mask
# rows (the pack gone, the GEMM is most of what is left at these sizes).
for n in 8 32; do
  log="$OUT/mlp-mask-rows-candidates-$n.log"
  bench "--tokens 16384,65536" TWELL_MASK_ROWS=on TWELL_GATE_CANDIDATES=$n > "$log" 2>&1
  stamp "== mask rows, gate from $n candidates (rc $?)"
  grep -E "^ +2048 +5632" "$log" | awk '{print $3, $4, $7, $8, $9, $10}'
done
