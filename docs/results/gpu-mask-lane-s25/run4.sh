#!/bin/bash
# Call 7 (session 25): check-gpu on the final build (the attention turning q, with the
# check's empty-cache case mended), the wgmma prefill kernel, then the mma.sync one.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s25/d/twell-new.xz > /tmp/twell-new && chmod +x /tmp/twell-new
/tmp/twell-new check-gpu > $OUT/check-final.log 2>&1; echo "check rc $?"; tail -1 $OUT/check-final.log; grep "turning q" $OUT/check-final.log
TWELL_ATTENTION=mma /tmp/twell-new check-gpu > $OUT/check-final-mma.log 2>&1; echo "check mma rc $?"; tail -1 $OUT/check-final-mma.log; grep "turning q" $OUT/check-final-mma.log
