# Shared by the session's device scripts (sourced): elapsed-time stamps, and check-gpu with
# knobs, its log under $OUT and its last line and first failures printed.
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
# check NAME [--mlp-only] [KNOB=VALUE...]: /tmp/twell-new check-gpu with the knobs set
# (--mlp-only: the sparse MLP's forward checks alone, for knobs of the forward kernels).
check() {
  local name=$1 only=
  shift
  if [ "${1:-}" = --mlp-only ]; then
    only=--mlp-only
    shift
  fi
  env "$@" timeout 200 /tmp/twell-new check-gpu $only > "$OUT/check-$name.log" 2>&1
  stamp "check-gpu $name $only ($*): rc $?, $(tail -n 1 "$OUT/check-$name.log")"
  grep -m 3 -i fail "$OUT/check-$name.log"
}
