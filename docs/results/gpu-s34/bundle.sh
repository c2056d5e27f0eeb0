#!/bin/bash
# Builds the release `twell` with --features cuda and packs it for the device tool's carry
# as .device/gpu/twell.xz (about 9.4 MB), the binary run1.sh unpacks. From the repository
# root: bash docs/results/gpu-s34/bundle.sh; then run(command="bash docs/results/gpu-s34/run1.sh",
# carry=[".device/gpu"]).
set -euo pipefail
# shellcheck disable=SC1091
. ../shared/cuda/setup-cuda-build.sh
target=${CARGO_TARGET_DIR:-$HOME/.cache/candle-twell/target-cuda}
CARGO_TARGET_DIR=$target cargo build --release --workspace --features cuda
mkdir -p .device/gpu
cp "$target/release/twell" /tmp/twell-device && strip /tmp/twell-device
xz -T2 -6 -c /tmp/twell-device > .device/gpu/twell.xz
ls -l .device/gpu/twell.xz
