#!/usr/bin/env bash
# Session 38 (for the next device; carry .device/s36/g and .device/s38/d). The build
# .device/s38/d holds three changes not yet run on a GPU:
#   - session 37's `PerKey` maps (decode scratch, driver values, cuBLASLt plans);
#   - session 37's `TWELL_GATE=lt` (the plain gate through cuBLASLt's fastest candidate);
#   - this session's overlapped launches, `TWELL_OVERLAP=on` (the pack, up and down
#     kernels launched with programmatic dependent launch, `crates/twell/src/cuda/launch.rs`);
#     the pack, up and down now launch through `launch::Args` either way.
# Checks both ways, then the whole MLP unprofiled (the overlap is off under --stages),
# old build (.device/s36/g, 0a2d083) / new / new+overlap / new+lt / new+lt+overlap
# alternating, two rounds; then eight layers a call (--chain 8) without and with the
# overlap; then a decode step old / new. Leaves /tmp/twell (the new
# build) for the fine-tune job, which can then skip `upload.sh d` while the machine is warm.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
. "$(dirname "$0")/lib.sh"
xz -dc -T8 .device/s36/g/twell.xz > /tmp/twell-old &
xz -dc -T8 .device/s38/d/twell.xz > /tmp/twell-new
wait
chmod +x /tmp/twell-old /tmp/twell-new && cp /tmp/twell-new /tmp/twell
stamp "unpacked"
check default
check overlap-lt TWELL_OVERLAP=on TWELL_GATE=lt
for round in 1 2; do
  for v in old new overlap lt lt-overlap; do
    bin=new
    knobs=()
    case $v in
      old) bin=old ;;
      overlap) knobs=(TWELL_OVERLAP=on) ;;
      lt) knobs=(TWELL_GATE=lt) ;;
      lt-overlap) knobs=(TWELL_GATE=lt TWELL_OVERLAP=on) ;;
    esac
    log="$OUT/mlp-$v-$round.log"
    env "${knobs[@]}" timeout 120 /tmp/twell-$bin bench mlp --device cuda --dtype bf16 \
      --shape 2048x5632 --tokens 2048,4096,16384,65536 --density 0.005,0.01,0.03 \
      --reps 15 --warmup 3 > "$log" 2>&1
    stamp "== $v, round $round (rc $?): M target dense sparse speedup auto"
    grep -E "^ +2048 +5632" "$log" | awk '{print $3, $4, $7, $8, $9, $10}'
  done
done
# Eight layers back to back a timed call (each on its own weights), as a model runs them:
# the per-call launch and sync (about 20 µs either side, thirty-fifth session) is paid
# once per eight layers, so the ratio nears the GPU's own (ncu: 1.74x at 2,048 rows, 0.5%).
for round in 1 2; do
  for v in new overlap; do
    knobs=()
    [ $v = overlap ] && knobs=(TWELL_OVERLAP=on)
    log="$OUT/chain-$v-$round.log"
    env "${knobs[@]}" timeout 120 /tmp/twell-new bench mlp --device cuda --dtype bf16 \
      --shape 2048x5632 --tokens 2048,16384 --density 0.005,0.01,0.03 --chain 8 \
      --weight-sets 8 --reps 11 --warmup 2 > "$log" 2>&1
    stamp "== chained 8, $v, round $round (rc $?): M target dense sparse speedup auto"
    grep -E "^ +2048 +5632" "$log" | awk '{print $3, $4, $7, $8, $9, $10}'
  done
done
for v in old new; do
  timeout 120 /tmp/twell-$v bench model --device cuda --dtype bf16 --shape 2048x5632x28 \
    --decode-batch 1 --prefill 1x512 --context 512 --decode-steps 32 --train "" --reps 3 \
    --energy-secs 0 > "$OUT/decode-$v.log" 2>&1
  stamp "== decode step, build $v (rc $?)"
  grep -E "^ +decode|enqueues" "$OUT/decode-$v.log"
done
