#!/usr/bin/env bash
# Stages what the device jobs carry (docs/device-queue.md) under an ignored folder, so that
# a clean clone can rebuild `.device/` before a device session:
#   scripts/stage-device.sh assets DIR   # DIR/a, DIR/b: the default GGUF's first two thirds;
#                                        # DIR/c: its last third and the speeches (sotu.tar.xz)
#   scripts/stage-device.sh build DIR    # DIR/twell.xz: the CUDA release `twell`, stripped
# A device call carries at most 64 MiB with the working tree (about 28 MB), so the 98 MB
# GGUF goes in three calls and the build (about 10 MB packed) beside one of them. The job
# scripts join the parts again (docs/results/finetune/run-lib.sh, `assemble_assets`) and
# print the GGUF's md5 to compare with the one printed here.
# `build` needs a CUDA build of the workspace first (docs/device-queue.md says how); it
# packs $CARGO_TARGET_DIR/release/twell (default ~/.cache/candle-twell/target-cuda).
set -euo pipefail

usage() {
  echo "usage: scripts/stage-device.sh assets|build DIR" >&2
  exit 2
}
[ $# -eq 2 ] || usage
what=$1
dir=$2
data=${TWELL_DATA:-data}
gguf=$data/SmolLM2-135M-Instruct.Q4_1.gguf

case $what in
assets)
  [ -f "$gguf" ] && [ -d "$data/sotu" ] || {
    echo "stage-device: $gguf or $data/sotu is missing; run scripts/setup.sh first" >&2
    exit 1
  }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # Three parts of equal size (the last takes the remainder): gguf.part-a, -b, -c.
  split -n 3 -a 1 "$gguf" "$tmp/gguf.part-"
  mkdir -p "$dir/a" "$dir/b" "$dir/c"
  mv "$tmp/gguf.part-a" "$dir/a/"
  mv "$tmp/gguf.part-b" "$dir/b/"
  mv "$tmp/gguf.part-c" "$dir/c/"
  tar cJf "$dir/c/sotu.tar.xz" -C "$data" sotu
  echo "stage-device: $dir/{a,b,c}; the joined GGUF's md5 is $(md5sum <"$gguf" | cut -d' ' -f1)"
  ;;
build)
  binary=${CARGO_TARGET_DIR:-$HOME/.cache/candle-twell/target-cuda}/release/twell
  [ -x "$binary" ] || {
    echo "stage-device: no CUDA build at $binary (see docs/device-queue.md)" >&2
    exit 1
  }
  mkdir -p "$dir"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cp "$binary" "$tmp/twell"
  strip "$tmp/twell"
  xz -T2 -6 -c "$tmp/twell" >"$dir/twell.xz"
  echo "stage-device: $dir/twell.xz ($(stat -c %s "$dir/twell.xz") bytes) from $binary"
  ;;
*)
  usage
  ;;
esac
