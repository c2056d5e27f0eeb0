#!/bin/bash
# Call 6 (session 29): check-gpu on the build after the review's mend (SparseMlp's two op
# branches through one keep_op_output).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s29/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 150 /tmp/twell check-gpu > $OUT/check-mend.log 2>&1
echo "check rc $?"; tail -1 $OUT/check-mend.log; grep FAIL $OUT/check-mend.log | head; grep 'auto above' $OUT/check-mend.log
