# run-lib.sh: what the device jobs of s10/s11/s12 share, sourced by their job.sh. Each
# job sets $common (the flags every run gets) before calling run.
#   run NAME FLAGS...: starts `twell finetune $common FLAGS --out $out/NAME` in the
#     background, resuming from the run's latest step-N checkpoint (left by --time-limit)
#     and skipping a run that has its final checkpoint;
#   pack_logs: after `wait`, prints each run's log tail and packs the logs into $OUT.
T=/tmp/twell; export TWELL_DATA=/tmp/assets/data
out=/tmp/runs; mkdir -p $out
run() {
  local name=$1; shift
  [ -d $out/$name/final ] && return
  local resume=() last
  last=$(ls -d $out/$name/step-* 2>/dev/null | sort -V | tail -1)
  [ -n "$last" ] && resume=(--resume "$last")
  # shellcheck disable=SC2086 # $common is a list of flags
  $T finetune $common "$@" ${resume[@]+"${resume[@]}"} --out $out/$name >> $out/$name.log 2>&1 &
}
pack_logs() {
  for f in $out/*.log; do echo "== $f"; tail -c 600 $f; echo; done
  mkdir -p /tmp/pack; for d in $out/*/; do n=$(basename $d); cp $d/train_log.jsonl /tmp/pack/$n.jsonl; cp $out/$n.log /tmp/pack/; done
  tar cJf $OUT/logs.tar.xz -C /tmp/pack .
}
