#!/usr/bin/env bash
# The calls before the job: `upload.sh a`, `upload.sh b` (parts a and b of the default
# GGUF) and `upload.sh d` (the build, and the sampled texts when there): a call carries at
# most 64 MiB with the working tree, so part c and the corpus come with the job's own calls
# (.device/s37/c).
mkdir -p /tmp/assets/data
for part in .device/s37/$1/gguf.part-*; do [ -e "$part" ] && cp "$part" /tmp/assets/; done
[ -e .device/s37/$1/twell.xz ] && xz -dc -T4 .device/s37/$1/twell.xz > /tmp/twell && chmod +x /tmp/twell
ls -la /tmp/assets /tmp/twell 2>&1 | tail -4
# Texts sampled by an earlier session (run-lib's sample_once packs them), carried beside the
# build when they are there.
if [ -e .device/s37/$1/samples.tar.xz ]; then
  . "$(dirname "$0")/../run-lib.sh"
  unpack_samples .device/s37/$1/samples.tar.xz
fi
