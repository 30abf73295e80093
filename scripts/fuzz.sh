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
for line in "${targets[@]}"; do
  read -r pkg name <<<"$line"
  echo "fuzz: $name in $pkg for $t"
  go test -run '^$' -fuzz "^${name}\$" -fuzztime "$t" "$pkg"
done
