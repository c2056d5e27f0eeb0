#!/bin/bash
# Call 1 (session 28): unpack this build and leave it, with part a of the default GGUF,
# in /tmp for the calls after (the fine-tuning pair, docs/results/finetune/val-target/);
# then check-gpu on this build (the first H200 run of session 27's CPU-checked mends and
# of rope.cu's shared eight-pair turn).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s28/twell.xz > /tmp/twell && chmod +x /tmp/twell
mkdir -p /tmp/assets && cp .device/s25/a/gguf.part-a /tmp/assets/
timeout 200 /tmp/twell check-gpu > $OUT/check.log 2>&1; rc=$?; echo "check rc $rc"; tail -1 $OUT/check.log
grep -v " ok$" $OUT/check.log | grep -v "^ *M \|^backward: " | head -8
