#!/usr/bin/env bash
# gotest.sh E2E_FIRST PKGS... — make test's `go test -race` over PKGS, with
# the end-to-end package (./e2e) run as two go test processes beside the
# others: the tests matching the regexp E2E_FIRST in one, the rest in the
# other. Its tests run one at a time within a process and each starts a
# whole mesh, so on its own it is the longest package by far (about 16 of
# the 20 minutes CI allows); split, its halves and the other packages keep
# both cores busy. Every process inherits the environment (the race-built
# service binaries, the dev PostgreSQL and Redis). Exits non-zero when any
# of the three does.
set -uo pipefail
first=${1:?usage: gotest.sh E2E_FIRST PKGS...}
shift
flags=(-race -count=1 -timeout 18m)
mapfile -t pkgs < <(go list "$@" | grep -v '/e2e$')
go test "${flags[@]}" "${pkgs[@]}" &
others=$!
go test "${flags[@]}" -run "$first" ./e2e &
e2e_a=$!
go test "${flags[@]}" -skip "$first" ./e2e &
e2e_b=$!
rc=0
wait "$others" || { rc=1; echo "gotest: packages other than e2e failed" >&2; }
wait "$e2e_a" || { rc=1; echo "gotest: e2e tests matching $first failed" >&2; }
wait "$e2e_b" || { rc=1; echo "gotest: e2e tests not matching $first failed" >&2; }
exit $rc
