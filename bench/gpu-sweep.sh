#!/usr/bin/env bash
# On a GPU machine: the GPU tests of a build, then `twell bench sweep` over the Llama
# family's MLP shapes with that build. Logs and JSON go to $OUT (default /tmp/out); the
# per-shape summary is printed last.
#   bench/gpu-sweep.sh DIR [SWEEP FLAGS...]
# DIR holds twell-new.xz (a stripped `twell` built with --features cuda) and gpu-tests.xz
# (`cargo test --release --features cuda --test gpu --no-run`'s binary).
set -u
dir=${1:?usage: gpu-sweep.sh DIR [SWEEP FLAGS...]}
shift
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for f in twell-new gpu-tests; do
  [ -x "/tmp/$f" ] || xz -dc -T4 "$dir/$f.xz" > "/tmp/$f" &
done
wait
chmod +x /tmp/twell-new /tmp/gpu-tests
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 240 /tmp/gpu-tests --test-threads 1 > "$out/gpu-tests.log" 2>&1
echo "GPU tests rc $?: $(grep -E '^test result' "$out/gpu-tests.log")"
grep -E 'FAILED|panicked' "$out/gpu-tests.log" | head -20
timeout 420 /tmp/twell-new bench sweep --device cuda --json "$out/sweep.json" "$@" > "$out/sweep.log" 2>&1
echo "sweep rc $?"
grep -E "^[0-9]+x[0-9]+: Auto|miss:" "$out/sweep.log"
