#!/usr/bin/env bash
# On a GPU machine: the GPU tests of a build, then one MLP layer of two `twell` builds side
# by side (alternating processes, two rounds) at the bar shape and a 7B-class shape, and
# the new build's kernel paths against each other. Every log goes to $OUT (default
# /tmp/out); a short table is printed last.
#   bench/gpu-mlp-two-builds.sh DIR [PART...]
# PART: tests, bar (hidden 2048 / d_ff 5632), 7b (hidden 4096 / d_ff 11008); default all three.
# DIR holds twell-old.xz and twell-new.xz (stripped `twell` builds with --features cuda)
# and gpu-tests.xz (`cargo test --release --features cuda --test gpu --no-run`'s binary).
set -u
dir=${1:?usage: gpu-mlp-two-builds.sh DIR [tests|bar|7b ...]}
shift
parts=${*:-tests bar 7b}
wants() { [[ " $parts " == *" $1 "* ]]; }
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for f in twell-old twell-new gpu-tests; do
  [ -x "/tmp/$f" ] || xz -dc -T4 "$dir/$f.xz" > "/tmp/$f" &
done
wait
chmod +x /tmp/twell-old /tmp/twell-new /tmp/gpu-tests
stamp() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader

if wants tests; then
  stamp "GPU tests"
  timeout 330 /tmp/gpu-tests --test-threads 1 > "$out/gpu-tests.log" 2>&1
  stamp "GPU tests rc $?: $(grep -E '^test result' "$out/gpu-tests.log")"
  grep -E '^test .* (ok|FAILED)$' "$out/gpu-tests.log"
fi

# mlp BUILD NAME SHAPE TOKENS DENSITIES [FLAGS...]: one `bench mlp` run, its JSON kept.
mlp() {
  local build=$1 name=$2 shape=$3 tokens=$4 density=$5
  shift 5
  timeout 150 "/tmp/twell-$build" bench mlp --device cuda --dtype bf16 --shape "$shape" \
    --tokens "$tokens" --density "$density" --reps 15 --warmup 3 --json "$out/$name.json" \
    "$@" > "$out/$name.log" 2>&1
  stamp "$name rc $?"
}
for round in 1 2; do
  wants bar || break
  mlp old "bar-old-$round" 2048x5632 1,2048,16384,65536 0.005,0.01,0.03
  mlp new "bar-new-$round" 2048x5632 1,2048,16384,65536 0.005,0.01,0.03
done
for round in 1 2; do
  wants 7b || break
  mlp old "7b-old-$round" 4096x11008 2048,16384 0.005,0.01
  mlp new "7b-new-$round" 4096x11008 2048,16384 0.005,0.01
  mlp new "7b-slots-$round" 4096x11008 2048,16384 0.005,0.01 --walk slots
done
python3 - "$out" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
print("run                 M      target  density  dense ms  sparse ms  sparse/dense  auto/dense")
for path in sorted(glob.glob(f"{out}/*.json")):
    name = os.path.basename(path)[:-5]
    for r in json.load(open(path))["rows"]:
        print(f"{name:<16} {r['tokens']:>7} {100*r['target_density']:>6.2f}% {100*r['measured_density']:>6.2f}% "
              f"{r['dense_ms']:>9.3f} {r['sparse_ms']:>10.3f} {r['speedup']:>12.2f}x {r['auto_speedup']:>10.2f}x")
PY
stamp done
