#!/usr/bin/env bash
# THE device script: install carried wheels, build libnorthmk with CUDA, then each stage
# that is switched on; logs under $OUT (all of them packed in $OUT/0run.tgz), a short table last.
#   SANITIZE=1  compute-sanitizer memcheck + racecheck on one step of a small 2-layer model and on
#               sliced nmk_sample draws (tools/sample_check.py), and racecheck on
#               tools/racecheck_bulk_probe.cu (the bulk-copy handshakes alone)
#   SANITIZE_FULL=1  memcheck and racecheck (SANITIZE_FULL_TOOLS) on one step of a 2-layer model of
#               the full geometry (North Mini Code's widths, 128 experts), the megakernel alone
#               instrumented: the reference's cuBLAS kernels, which racecheck flags on their own,
#               run as they are
#   DIAG=1      per-layer divergence of full-geometry steps (tools/mk_diagnose.py)
#   TESTS=1     the GPU tests (pytest -k "$1")        BENCH=1  the decode benchmark (args after $1)
#               (both on when no stage is named; naming any stage runs only the stages named)
#   DRY_RUN=1   print the stages the call would run and stop (before the wheels and the build)
#   SERVER=1    the server's API tests with the engine on the GPU (the tiny model: PyTorch backend)
#   MOE=1       tools/moe_bench.py: one sparse layer's experts in the PyTorch prefill, row-major (torch's
#               grouped GEMM) against the tiled layout (Triton), into $OUT
#   GEMV=1      tools/gemv_bench.cu: the GEMV paths' bandwidth per shape, checked (GEMV_ARGS, e.g. --quick)
#   EXECUTOR=1  tools/executor_bench.cu: one executor of 8 warps per SM against two of 4 on a batch-1
#               layer's GEMV mix, checked (EXECUTOR_ARGS, default four --spin-ns waits)
#   CLUSTER=1   tools/cluster_probe.cu: clusters of the megakernel's shape resident at once, and a
#               flag's round trip through L2 against a cluster peer's shared memory (CLUSTER_ARGS)
#   LOCKSTEP=1  tools/lockstep_probe.cu: o-proj- and QKV-shaped tiles streamed by CTAs started
#               together, apart, at a padded stride or in a rotated order (LOCKSTEP_ARGS)
#   PEER=1      the transformers peer alone (bench --peer-only, PEER_ARGS, its own PEER_TIMEOUT: its
#               torch.compile of the full model takes minutes), into $OUT/peer
#   ENGINE=1    tools/engine_bench.py: decode through AsyncEngine on the megakernel backend, decode_ahead
#               on and off (ENGINE_ARGS, default --batch 1 8 --steps 256 --both), into $OUT
#   NCU=1       ncu --clock-control none on one timed step of the decode bench at batch NCU_BATCH (1):
#               the step's DRAM bytes read and written, the L2 sectors the SMs read and its hit rate
#               (NCU_METRICS), by application replay (a kernel replay would save the weights' memory);
#               with NCU_SECTIONS (e.g. PmSampling) those sections instead of the metrics, NCU_EXTRA
#               more ncu options (e.g. --pm-sampling-interval 1000); with those sections or a
#               pmsampling: metric (NCU_METRICS=pmsampling:dram__bytes_read.sum) the report is kept
#               as $OUT/ncu-report.ncu-rep and its raw page with every metric's instances (PM
#               sampling's time series, in base units) as $OUT/ncu-raw.csv (tools/pm_timeline.py).
#               NCU_SKIP: the megakernel launches skipped (2: the bench's second timed step; 5: its
#               profiled step, so that ncu-bench/task-times-*.npy is the same launch)
#   tools/gpu_run.sh [pytest -k expr] [bench args...]
# Pass NORTHMK_COMMIT=$(git rev-parse --short HEAD)[-dirty] from the host: the device copy has no git.
# The wheels the image lacks come from tools/fetch_wheels.sh (carry .whl).
set -uo pipefail
OUT=${OUT:-/tmp/out}
# Every stage is off unless set to 1, but TESTS and BENCH, which are on when no stage is named.
stages=(SANITIZE SANITIZE_FULL DIAG SERVER PEER NCU ENGINE MOE GEMV EXECUTOR CLUSTER LOCKSTEP TESTS BENCH)
named=0
for stage in "${stages[@]}"; do [ "${!stage:-0}" = 1 ] && named=1; done
TESTS=${TESTS:-$((1 - named))} BENCH=${BENCH:-$((1 - named))}
for stage in "${stages[@]}"; do printf -v "$stage" '%s' "${!stage:-0}"; done
if [ "${DRY_RUN:-0}" = 1 ]; then  # the stages this call would run, and nothing else
  for stage in "${stages[@]}"; do [ "${!stage}" = 1 ] && echo "$stage"; done
  exit 0
fi
mkdir -p "$OUT"
# The bench measures the peer itself at every batch unless told --no-peer (minutes more): with
# PEER=1 as well the peer runs twice, and a device call's limit can cut the stages after it.
if [ "$BENCH" = 1 ] && [ "$PEER" = 1 ] && [[ " ${*:2} " != *" --no-peer "* ]]; then
  echo "WARNING: BENCH=1 without --no-peer measures the peer in the bench too; PEER=1 runs it again"
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "WARNING: no wheels in .whl/ (carry .whl): the image lacks nvidia-cutlass, which the CUDA build needs"
fi
export PATH=$PATH:/usr/local/cuda/bin
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/device.txt"

t0=$(date +%s)
# NORTHMK_CUDA=on: a library without the megakernel fails here, not in every stage after it
cmake -S . -B build/gpu -G Ninja -DNORTHMK_CUDA=on -DCMAKE_CUDA_FLAGS="-Xptxas -v" >"$OUT/build.log" 2>&1 \
  && cmake --build build/gpu -j 16 >>"$OUT/build.log" 2>&1
build_rc=$?
grep -E "registers|spill|error" "$OUT/build.log" | sort | uniq -c | head -12
# ptxas serializing every wgmma of a kernel (a call inside a wgmma region) cost the step 14% once
grep -q C7510 "$OUT/build.log" && echo "WARNING: ptxas serialized the megakernel's wgmma (C7510; build.log)"
export NORTHMK_LIB=$PWD/build/gpu/libnorthmk.so
echo "build rc=$build_rc in $(( $(date +%s) - t0 ))s"
[ $build_rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }

san_rc=- diag_rc=- tests_rc=- bench_rc=- server_rc=- peer_rc=- gemv_rc=- executor_rc=- cluster_rc=- lockstep_rc=- ncu_rc=- engine_rc=- moe_rc=-
# run_tool NAME TARGET LIMIT [ARGS...]: builds a tool's target and runs it for at most LIMIT
# seconds, both into $OUT/NAME.log; returns its status.
run_tool() {
  local log=$OUT/$1.log target=$2 limit=$3
  shift 3
  cmake --build build/gpu --target "$target" -j 16 >"$log" 2>&1 && timeout "$limit" "build/gpu/$target" "$@" >>"$log" 2>&1
}
if [ "$GEMV" = 1 ]; then
  t0=$(date +%s)
  run_tool gemv northmk_gemv_bench "${GEMV_TIMEOUT:-90}" ${GEMV_ARGS:-}
  gemv_rc=$?
  echo "gemv bench rc=$gemv_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$EXECUTOR" = 1 ]; then
  t0=$(date +%s)
  run_tool executor northmk_executor_bench "${EXECUTOR_TIMEOUT:-300}" \
    ${EXECUTOR_ARGS:---spin-ns 0 --spin-ns 500 --spin-ns 1000 --spin-ns 2000}
  executor_rc=$?
  echo "executor bench rc=$executor_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$CLUSTER" = 1 ]; then
  t0=$(date +%s)
  run_tool cluster northmk_cluster_probe "${CLUSTER_TIMEOUT:-120}" ${CLUSTER_ARGS:-}
  cluster_rc=$?
  echo "cluster probe rc=$cluster_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$LOCKSTEP" = 1 ]; then
  t0=$(date +%s)
  run_tool lockstep northmk_lockstep_probe "${LOCKSTEP_TIMEOUT:-120}" ${LOCKSTEP_ARGS:-}
  lockstep_rc=$?
  echo "lockstep probe rc=$lockstep_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$SANITIZE" = 1 ]; then
  # racecheck on the bulk-copy handshakes alone (tools/racecheck_bulk_probe.cu): what the tool
  # reports there is its model of the pattern, which the attention ring shares
  cmake --build build/gpu --target northmk_racecheck_probe -j 16 >"$OUT/sanitize-probe.log" 2>&1 \
    && timeout 60 compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 5 build/gpu/northmk_racecheck_probe \
    >>"$OUT/sanitize-probe.log" 2>&1
  rc=$?; san_rc="$san_rc probe=$rc"
  echo "racecheck probe rc=$rc"; grep -E "RACECHECK SUMMARY|probe:|Error" "$OUT/sanitize-probe.log" | head -4
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    timeout 75 compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 \
      python3 tools/mk_diagnose.py --small --layers 2 --contexts 1 200 >"$OUT/sanitize-$tool.log" 2>&1
    rc=$?; san_rc="$san_rc $tool=$rc"
    echo "$tool rc=$rc in $(( $(date +%s) - t0 ))s"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|hazard|first divergence|^row" "$OUT/sanitize-$tool.log" | head -5
    # nmk_sample: a row's slices meeting at barriers in global scratch (tools/sample_check.py)
    timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 \
      python3 tools/sample_check.py >"$OUT/sanitize-sample-$tool.log" 2>&1
    rc=$?; san_rc="$san_rc sample-$tool=$rc"
    echo "sample $tool rc=$rc"; grep -E "SUMMARY|Invalid|hazard|differ" "$OUT/sanitize-sample-$tool.log" | head -4
  done
fi
if [ "$SANITIZE_FULL" = 1 ]; then
  # the kernel filter's option: --kernel-name (current releases) or --filter (older ones)
  only=(--filter kns=megakernel)
  compute-sanitizer --help 2>/dev/null | grep -q -- "--kernel-name" && only=(--kernel-name kns=megakernel)
  for tool in ${SANITIZE_FULL_TOOLS:-memcheck racecheck}; do
    t0=$(date +%s)
    timeout ${SANITIZE_FULL_TIMEOUT:-200} compute-sanitizer --tool $tool "${only[@]}" --error-exitcode 9 \
      --print-limit 20 python3 tools/mk_diagnose.py --layers 2 --contexts 1 200 >"$OUT/sanitize-full-$tool.log" 2>&1
    rc=$?; san_rc="$san_rc full-$tool=$rc"
    echo "full-geometry $tool (${only[*]}) rc=$rc in $(( $(date +%s) - t0 ))s"
    grep -E "SUMMARY|hazard|Invalid|first divergence|^row|rror" "$OUT/sanitize-full-$tool.log" | head -8
  done
fi
if [ "$DIAG" = 1 ]; then
  t0=$(date +%s)
  { timeout 80 python3 tools/mk_diagnose.py --layers 49 --contexts 1 100 4095 4097 8192 --out "$OUT";
    timeout 50 python3 tools/mk_diagnose.py --layers 4 --contexts 37 300 --steps 3 --out "$OUT"; } >"$OUT/diag.log" 2>&1
  diag_rc=$?
  echo "diag rc=$diag_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$TESTS" = 1 ]; then
  t0=$(date +%s)
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest tests/gpu -q ${GPU_TEST_FLAGS:--x} -p no:cacheprovider ${1:+-k "$1"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  tests_rc=${PIPESTATUS[0]}
  echo "gpu tests rc=$tests_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$SERVER" = 1 ]; then
  t0=$(date +%s)
  NORTHMK_TEST_DEVICE=cuda timeout ${SERVER_TIMEOUT:-170} python3 -m pytest tests/server -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/server_tests.log" | tail -15
  server_rc=${PIPESTATUS[0]}
  echo "server tests (cuda) rc=$server_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$BENCH" = 1 ]; then
  t0=$(date +%s)
  shift || true
  timeout ${BENCH_TIMEOUT:-540} python3 -m northmk.bench decode --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
  bench_rc=${PIPESTATUS[0]}
  echo "bench rc=$bench_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$ENGINE" = 1 ]; then
  t0=$(date +%s)
  timeout ${ENGINE_TIMEOUT:-300} python3 tools/engine_bench.py ${ENGINE_ARGS:---batch 1 8 --steps 256 --both} \
    --out "$OUT" 2>&1 | grep -v '^{' | tee "$OUT/engine.log" | tail -6
  engine_rc=${PIPESTATUS[0]}
  echo "engine bench rc=$engine_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$MOE" = 1 ]; then
  t0=$(date +%s)
  timeout ${MOE_TIMEOUT:-120} python3 tools/moe_bench.py ${MOE_ARGS:-} --out "$OUT" >"$OUT/moe.log" 2>&1
  moe_rc=$?
  echo "moe bench rc=$moe_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$PEER" = 1 ]; then
  t0=$(date +%s)
  timeout ${PEER_TIMEOUT:-420} python3 -m northmk.bench decode --peer-only ${PEER_ARGS:---batch 1 8 --steps 256} \
    --out "$OUT/peer" 2>&1 | tee "$OUT/peer.log" | tail -8
  peer_rc=${PIPESTATUS[0]}
  echo "peer rc=$peer_rc in $(( $(date +%s) - t0 ))s"
fi
if [ "$NCU" = 1 ]; then
  # The bench launches the megakernel for its warm-up step, then its timed ones: skip to the second.
  t0=$(date +%s)
  metrics=${NCU_METRICS:-gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct}
  what=(--metrics "$metrics") keep=0
  if [ -n "${NCU_SECTIONS:-}" ]; then
    what=() keep=1
    for s in $NCU_SECTIONS; do what+=(--section "$s"); done
  fi
  [[ "$metrics" == *pmsampling:* ]] && keep=1
  [ "$keep" = 1 ] && what+=(-o "$OUT/ncu-report")
  # shellcheck disable=SC2086 # NCU_EXTRA: options, split on spaces
  timeout ${NCU_TIMEOUT:-240} ncu --clock-control none --replay-mode application --kernel-name regex:megakernel \
    --launch-skip ${NCU_SKIP:-2} --launch-count 1 "${what[@]}" ${NCU_EXTRA:-} \
    python3 -m northmk.bench decode --out "$OUT/ncu-bench" --batch ${NCU_BATCH:-1} --steps 4 --warmup 1 --no-peer \
    >"$OUT/ncu.log" 2>&1
  ncu_rc=$?
  if [ "$keep" = 1 ] && [ -f "$OUT/ncu-report.ncu-rep" ]; then
    ncu -i "$OUT/ncu-report.ncu-rep" --page raw --csv --print-units base --print-metric-instances values \
      >"$OUT/ncu-raw.csv" 2>>"$OUT/ncu.log"
    ncu -i "$OUT/ncu-report.ncu-rep" --page details --print-details all >>"$OUT/ncu.log" 2>&1
  fi
  echo "ncu rc=$ncu_rc in $(( $(date +%s) - t0 ))s"
fi
# Everything under $OUT in one file, first in name order: the device call returns only a few of
# $OUT's files (the JSONs, the sanitizers' and tests' logs, the profiled steps come back in it).
# Files named 0* are left out: the caller's own logs, still being written, which come back anyway.
# (Written outside $OUT first: tar fails on a folder that changes while it reads it.)
packed=$(mktemp /tmp/0run.XXXXXX.tgz)
if tar -czf "$packed" -C "$OUT" --exclude='./0*' . && chmod 644 "$packed" && mv "$packed" "$OUT/0run.tgz"; then
  [ "$(stat -c %s "$OUT/0run.tgz")" -le $((16 << 20)) ] || echo "WARNING: $OUT/0run.tgz is over 16 MiB: it will not come back"
else
  echo "could not pack $OUT/0run.tgz"
fi
echo "== summary: build $build_rc, gemv $gemv_rc, executor $executor_rc, cluster $cluster_rc, lockstep $lockstep_rc, sanitize [$san_rc], diag $diag_rc, tests $tests_rc, server $server_rc, bench $bench_rc, peer $peer_rc, ncu $ncu_rc, engine $engine_rc, moe $moe_rc"
[ "$GEMV" = 1 ] && tail -30 "$OUT/gemv.log"
[ "$EXECUTOR" = 1 ] && grep -vE "registers|spill|ptxas|Compiling|^\[" "$OUT/executor.log" | tail -30
[ "$CLUSTER" = 1 ] && grep -E "SMs|occupancy|round trip|error|usage" "$OUT/cluster.log"
[ "$LOCKSTEP" = 1 ] && grep -E "SMs|round|error|usage" "$OUT/lockstep.log"
[ "$DIAG" = 1 ] && grep -E "^ +(0|1|2|3|4|48|49) |^row|first divergence|routing errors" "$OUT/diag.log" | head -40
[ "$TESTS" = 1 ] && grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
[ "$BENCH" = 1 ] && grep -E "^batch|copy bandwidth|span" "$OUT/bench.log"
[ "$PEER" = 1 ] && grep -E "^batch" "$OUT/peer.log"
[ "$ENGINE" = 1 ] && grep -E "^engine batch" "$OUT/engine.log" | sed -E 's/; loop thread.*//'
[ "$MOE" = 1 ] && tail -6 "$OUT/moe.log"
[ "$NCU" = 1 ] && grep -E "megakernel|__|==ERR|==WARN" "$OUT/ncu.log" | tail -12
exit 0
