#!/usr/bin/env bash
# The test command: fetches the default model and corpus (idempotent), then runs every test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
cargo test --release --workspace "$@"
