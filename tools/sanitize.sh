#!/usr/bin/env bash
# Builds libnorthmk's host code with AddressSanitizer + UndefinedBehaviorSanitizer
# (NORTHMK_SANITIZE=ON, NORTHMK_CUDA=off) in build/sanitize, then runs the C tests and the
# pool + loop stress test under them. Exits non-zero on any failure or sanitizer report.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build/sanitize"
flags=(-std=c99 -Wall -Wextra -Werror -pedantic -g -fsanitize=address,undefined
       -fno-sanitize-recover=all -fno-omit-frame-pointer -pthread -I"$root/include")
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0:exitcode=23"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=24"

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$root" -B "$build" "${generator[@]}" -DNORTHMK_SANITIZE=ON -DNORTHMK_CUDA=off \
      -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build "$build" -j "$(nproc)"

for src in "$root"/tests/native/c/test_*.c "$root"/tests/native/c/stress.c; do
    name="$(basename "$src" .c)"
    cc "${flags[@]}" "$src" -L"$build" -lnorthmk -Wl,-rpath,"$build" -o "$build/$name"
    echo "== $name"
    if [ "$name" = stress ]; then
        "$build/$name" 1500 7
    else
        "$build/$name"
    fi
done
echo "sanitize: clean"
