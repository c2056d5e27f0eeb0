# run-lib.sh: what the device jobs of s10 and after share, sourced by their job.sh. Each
# job sets $common (the flags every run gets) before calling run.
#   run NAME FLAGS...: starts `twell finetune $common FLAGS --out $out/NAME` in the
#     background, resuming from the run's latest step-N checkpoint (left by --time-limit)
#     and skipping a run that has its final checkpoint; with GPU=N set, on GPU N alone
#     (a machine of several GPUs runs one run a GPU);
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
  ${GPU:+env CUDA_VISIBLE_DEVICES=$GPU} \
    $T finetune $common "$@" ${resume[@]+"${resume[@]}"} --out $out/$name >> $out/$name.log 2>&1 &
}
pack_logs() {
  for f in $out/*.log; do echo "== $f"; tail -c 600 $f; echo; done
  mkdir -p /tmp/pack; for d in $out/*/; do n=$(basename $d); cp $d/train_log.jsonl /tmp/pack/$n.jsonl; cp $out/$n.log /tmp/pack/; done
  tar cJf $OUT/logs.tar.xz -C /tmp/pack .
}
# assemble_assets DIR: the default GGUF from parts a and b (left in /tmp/assets by earlier
#   calls) and DIR/gguf.part-c, and the speeches from DIR/sotu.tar.xz, once per machine.
assemble_assets() {
  [ -e $TWELL_DATA/SmolLM2-135M-Instruct.Q4_1.gguf ] && return
  mkdir -p $TWELL_DATA
  cat /tmp/assets/gguf.part-a /tmp/assets/gguf.part-b $1/gguf.part-c > $TWELL_DATA/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum $TWELL_DATA/SmolLM2-135M-Instruct.Q4_1.gguf   # a1231443440b107ff29f02bdb38c9d0a
  tar xJf $1/sotu.tar.xz -C $TWELL_DATA
}
# sample_once: the teacher's texts into /tmp/samples (COUNT, default 8192; seed 0), once
#   per machine, unless SAMPLE=0 or an upload call has unpacked them already (unpack_samples).
#   Texts sampled here are also packed into $OUT/samples.tar.xz, so that a later session
#   can carry them (beside its build) instead of sampling again (about 75 s of device time).
sample_once() {
  [ "${SAMPLE:-1}" = 1 ] && [ ! -e /tmp/samples/done ] || return 0
  timeout ${SAMPLE_SECS:-200} $T sample --device cuda --count ${COUNT:-8192} --batch 256 \
    --prompt-tokens 32 --max-tokens 480 --temperature 0.8 --seed 0 --out /tmp/samples 2>&1 \
    | tr '\r' '\n' | tail -3
  touch /tmp/samples/done
  tar cJf $OUT/samples.tar.xz -C /tmp samples
}
# unpack_samples FILE: the texts an earlier session's sample_once packed, into /tmp/samples.
unpack_samples() {
  [ -e "$1" ] && tar xJf "$1" -C /tmp && ls /tmp/samples | wc -l
}
# prepare_job DIR: what a job does before its runs: the CUDA libraries on the loader's
#   path, the assets (assemble_assets DIR) and the teacher's texts (sample_once).
prepare_job() {
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64
  assemble_assets "$1"
  sample_once
}
