#!/bin/bash
# Call 3 (session 26): the 28-layer prefill at 16 x 2048 on the default path (in-place),
# four processes, for the energy per token's spread across processes.
CHECK=0 TAG=c bash docs/results/gpu-rope-s26/run1.sh in-place in-place in-place in-place
