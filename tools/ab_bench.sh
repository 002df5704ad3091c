#!/usr/bin/env bash
# A/B runs of the decode benchmark in one device call: each variant tree under ab/ (made on the
# host by `tools/ab_bench.sh prepare NAME REV`, once per variant: its library's sources and its
# Python package), its library built and benched in turn by its own package, with the same
# arguments. ab/ is ignored by git: carry it (with .whl, as for gpu_run.sh).
#   host:   tools/ab_bench.sh prepare base 17c7d34 && tools/ab_bench.sh prepare new HEAD
#   device: tools/ab_bench.sh run --batch 1 8 --steps 256 --no-peer
# Each result lands in $OUT/ab-NAME-rROUND/, and all of them with the logs in $OUT/0ab.tgz (first
# in name order: the device call returns a few files of $OUT, so this one holds them all); the
# last lines are one table row per (variant, round, batch).
set -uo pipefail
shopt -s nullglob
if [ "${1:-}" = prepare ]; then
  [ $# -eq 3 ] || { echo "usage: $0 prepare NAME REV" >&2; exit 2; }
  name=$2 rev=$3
  git rev-parse --verify -q "$rev^{commit}" >/dev/null || { echo "$0: $rev is not a revision" >&2; exit 2; }
  rm -rf "ab/$name" && mkdir -p "ab/$name"
  git archive "$rev" CMakeLists.txt pyproject.toml include cuda tools northmk | tar -x -C "ab/$name"
  git rev-parse --short "$rev" >"ab/$name/COMMIT"  # the results' commit (the device copy has no git)
  echo "ab/$name: $(cat "ab/$name/COMMIT")"
  exit 0
fi
[ "${1:-}" = run ] || { echo "usage: $0 prepare NAME REV | run [bench args...]" >&2; exit 2; }
shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd) root=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
else
  echo "WARNING: no wheels in .whl/ (carry .whl): the image lacks nvidia-cutlass, which the CUDA build needs"
fi
export PATH=$PATH:/usr/local/cuda/bin
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# Build every variant (all at once, sharing the cores), then bench them in turn AB_ROUNDS times
# (default 2): the device runs a little faster as a call goes on, so each variant takes every
# position once per round.
trees=(ab/*/)
[ ${#trees[@]} -gt 0 ] || { echo "$0: no variant built (tools/ab_bench.sh prepare NAME REV first)" >&2; exit 1; }
jobs=$(( $(nproc) / ${#trees[@]} )); [ "$jobs" -ge 1 ] || jobs=1
t0=$(date +%s)
for tree in "${trees[@]}"; do
  name=$(basename "$tree")
  { cmake -S "$tree" -B "build/ab-$name" -G Ninja -DNORTHMK_CUDA=on >"$OUT/ab-$name.build.log" 2>&1 &&
    cmake --build "build/ab-$name" -j "$jobs" >>"$OUT/ab-$name.build.log" 2>&1; echo $? >"$OUT/ab-$name.build.rc"; } &
done
wait
names=()
for tree in "${trees[@]}"; do
  name=$(basename "$tree")
  if [ "$(cat "$OUT/ab-$name.build.rc")" != 0 ]; then
    echo "$name: build failed"; tail -20 "$OUT/ab-$name.build.log"; continue
  fi
  grep -q C7510 "$OUT/ab-$name.build.log" && echo "$name: WARNING: ptxas serialized the megakernel's wgmma (C7510)"
  # The variant's own package must be the one its bench imports: an editable install of northmk
  # (a meta-path finder) comes before the working directory and would bench the installed tree.
  got=$(cd "$tree" && python3 -c 'import os, northmk; print(os.path.realpath(os.path.dirname(northmk.__file__)))' 2>&1 | tail -1)
  if [ "${got:0:1}" != / ]; then
    echo "$name: python3 cannot import ${tree}northmk (${got:-no output}): skipped"
    continue
  elif [ "$got" != "$(cd "$tree/northmk" && pwd -P)" ]; then
    echo "$name: python3 imports northmk from $got, not ${tree}northmk (an installed northmk shadows it): skipped"
    continue
  fi
  names+=("$name")
done
rm -f "$OUT"/ab-*.build.rc
echo "built ${names[*]} in $(( $(date +%s) - t0 ))s"
[ ${#names[@]} -gt 0 ] || { echo "$0: no variant built (tools/ab_bench.sh prepare NAME REV first)" >&2; exit 1; }
for round in $(seq "${AB_ROUNDS:-2}"); do
  n=${#names[@]}
  for k in $(seq 0 $(( n - 1 ))); do
    name=${names[$(( (k + round - 1) % n ))]}
    # run from the variant's tree: its own package comes first on the path
    (cd "ab/$name" && NORTHMK_COMMIT=$(cat COMMIT) NORTHMK_LIB=$root/build/ab-$name/libnorthmk.so \
      timeout ${AB_TIMEOUT:-120} python3 -m northmk.bench decode --out "$OUT/ab-$name-r$round" "$@") \
      >"$OUT/ab-$name-r$round.log" 2>&1
    echo "round $round: $name rc=$?"
  done
done
(cd "$OUT" && tar -czf 0ab.tgz ab-*) || echo "$0: could not pack $OUT/0ab.tgz"
for name in "${names[@]}"; do
  for round in $(seq "${AB_ROUNDS:-2}"); do
    grep -E "^batch" "$OUT/ab-$name-r$round.log" 2>/dev/null | sed "s/^/$name r$round  /"
  done
done
