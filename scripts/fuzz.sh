#!/usr/bin/env bash
# fuzz.sh DURATION [DIR...] — runs every Go fuzz target in the module (or
# only those under the given directories) for DURATION each.
set -euo pipefail
cd "$(dirname "$0")/.."
t=${1:-10s}
shift || true
dirs=("$@")
[ ${#dirs[@]} -gt 0 ] || dirs=(.)
mapfile -t targets < <(grep -rl --include='*_test.go' -E '^func Fuzz[A-Za-z0-9_]+\(f \*testing\.F\)' "${dirs[@]}" |
  while read -r f; do
    pkg=./$(dirname "${f#./}")
    grep -oE '^func Fuzz[A-Za-z0-9_]+' "$f" | sed "s|^func |$pkg |"
  done | sort -u)
if [ ${#targets[@]} -eq 0 ]; then echo "fuzz: no targets"; exit 0; fi
# fuzz_once PKG NAME: one run; its output on stdout and in $out.
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fuzz_once() { go test -run '^$' -fuzz "^${2}\$" -fuzztime "$t" "$1" 2>&1 | tee "$out"; }
# Go's fuzzing coordinator can fail a run at the -fuzztime boundary with a
# bare "context deadline exceeded" and no input (golang/go#75804, #51484: a
# race between its deadline and a worker still executing, under CPU
# contention). Such a run is retried, twice at most; a run that wrote a
# failing input, or any other failure, fails at once.
for line in "${targets[@]}"; do
  read -r pkg name <<<"$line"
  for attempt in 1 2 3; do
    echo "fuzz: $name in $pkg for $t${attempt:+ (attempt $attempt)}"
    if fuzz_once "$pkg" "$name"; then continue 2; fi
    if grep -q 'Failing input written' "$out" || ! grep -q '^    context deadline exceeded$' "$out"; then exit 1; fi
    echo "fuzz: $name: the coordinator's fuzztime deadline race (no failing input); again"
  done
  exit 1
done
