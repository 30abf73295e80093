#!/usr/bin/env bash
# s3server.sh — a real S3-compatible server for the tests and the dev stack:
# versitygw (VERSITYGW_VERSION, default v1.8.0; Apache-2.0,
# github.com/versity/versitygw) built once from the Go module proxy into
# .dev/bin/versitygw (`go install pkg@version`: never the project's go.mod;
# on two idle cores ~2.5 minutes, ~4.5 with an empty Go build cache).
#
#   scripts/s3server.sh build        build .dev/bin/versitygw unless it is there
#                                    (or wait for the background build); log in
#                                    .dev/logs/versitygw-build.log
#   scripts/s3server.sh build-bg     the same in the background, returning at once
#                                    (`make deps`): pid in .dev/pids/versitygw-build,
#                                    "EXIT-STATUS SECONDS" in .dev/versitygw-build.status
#                                    when it ends; nothing when the binary is there or
#                                    a build is running
#   scripts/s3server.sh wait [SECS]  wait (default 900 s) for that build and say how
#                                    it went; non-zero when it failed or is still
#                                    running (`make test`, right before `go test`);
#                                    builds in the foreground when none was started
#   scripts/s3server.sh up           build, then start (or reuse) a dev server on
#                                    127.0.0.1:${KVMESH_DEV_S3_PORT:-17070} with the
#                                    bucket kvmesh; writes KVMESH_DEV_TIER_URL,
#                                    KVMESH_DEV_TIER_ACCESS_KEY and
#                                    KVMESH_DEV_TIER_SECRET_KEY into .dev/env
#   scripts/s3server.sh down         stop the dev server and drop those lines
#   scripts/s3server.sh status       say what is built and running
#
# The dev server is versitygw's posix backend: bucket B's object K is the
# plain file .dev/s3/data/B/K ('/' in K makes directories), its metadata
# (ETag, x-amz-meta-*, content type, checksums) sidecar files under
# .dev/s3/meta/B/K/meta/ (--sidecar: no extended attributes needed, so any
# filesystem will do). Its root credentials are made once, at random, into
# .dev/s3/credentials; its log is .dev/logs/versitygw.log, its pid
# .dev/s3/versitygw.pid. Tests start private servers of their own
# (internal/testenv/s3.go) from the same binary.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dev="$root/.dev"
self="$root/scripts/s3server.sh"
mkdir -p "$dev/logs" "$dev/pids" "$dev/bin"
cd "$root"
command -v go >/dev/null || export PATH=/usr/local/go/bin:$PATH

VERSITYGW_VERSION=${VERSITYGW_VERSION:-v1.8.0}
pkg=github.com/versity/versitygw/cmd/versitygw
bin="$dev/bin/versitygw"
build_log="$dev/logs/versitygw-build.log"
build_pid="$dev/pids/versitygw-build"
build_status="$dev/versitygw-build.status"
s3="$dev/s3"
port=${KVMESH_DEV_S3_PORT:-17070}
bucket=kvmesh
region=us-east-1
server_pid="$s3/versitygw.pid"

say() { printf 's3server: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# wait_for SECONDS CMD... polls CMD until it succeeds or the deadline passes.
wait_for() {
  local end=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || return 1
    sleep 0.2
  done
}

in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# alive PIDFILE WORD: the process in PIDFILE runs, and its command line has
# WORD in it (a stale pid file whose pid was reused says no).
alive() {
  local pid cmd
  [ -f "$1" ] && pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  [ -r "/proc/$pid/cmdline" ] || return 0
  cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  [[ $cmd == *"$2"* ]]
}

build_running() { alive "$build_pid" s3server.sh; }

# compiled: how many packages the running or last build compiled (go -v
# prints one line per package).
compiled() {
  local n
  n=$(grep -c '^[a-z]' "$build_log" 2>/dev/null) || true
  echo "${n:-0}"
}

# do_build builds the binary in the foreground, printing progress every 30
# seconds. A lock keeps two builds from running at once (the second finds
# the binary built); the lock's descriptor is closed before anything else
# runs, so that a server started later does not hold it.
do_build() {
  local rc=0
  exec 9>"$dev/versitygw-build.lock"
  if command -v flock >/dev/null; then flock 9; fi
  build_locked || rc=$?
  exec 9>&-
  return "$rc"
}

# build_locked builds into a folder of its own first, so that nobody ever
# runs a half-written .dev/bin/versitygw. It runs where `set -e` does not
# apply (do_build's `||`): every step checks for itself.
build_locked() {
  local tmp="$dev/versitygw-build" start=$SECONDS pid rc=0 next=30
  if [ -x "$bin" ]; then return 0; fi
  rm -rf "$tmp" && mkdir -p "$tmp" || { say "error: cannot make $tmp"; return 1; }
  say "building versitygw $VERSITYGW_VERSION into .dev/bin/versitygw (once; 2-5 minutes; log: .dev/logs/versitygw-build.log)"
  # From a folder outside the module (GOWORK=off): `go install pkg@version`
  # resolves versitygw's own go.mod, whatever the project's says.
  (
    exec 9>&-
    cd "$tmp" || exit 1
    export GOWORK=off GOBIN="$tmp" GOFLAGS=-trimpath
    exec go install -v -ldflags='-s -w' "$pkg@$VERSITYGW_VERSION"
  ) >"$build_log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ $((SECONDS - start)) -ge $next ]; then
      say "still building: $((SECONDS - start))s, $(compiled) packages compiled"
      next=$((next + 30))
    fi
  done
  wait "$pid" || rc=$?
  if [ "$rc" != 0 ] || [ ! -x "$tmp/versitygw" ]; then
    tail -n 20 "$build_log" >&2 || true
    say "error: the versitygw build failed (exit $rc); see .dev/logs/versitygw-build.log"
    return 1
  fi
  mv "$tmp/versitygw" "$bin" || { say "error: cannot move the binary into .dev/bin"; return 1; }
  rm -rf "$tmp"
  say "versitygw $VERSITYGW_VERSION built in $((SECONDS - start))s ($(compiled) packages)"
}

# build_job is what build-bg runs in the background.
build_job() {
  local start=$SECONDS rc=0
  echo $$ >"$build_pid"
  do_build || rc=$?
  echo "$rc $((SECONDS - start))" >"$build_status"
  [ "$(cat "$build_pid" 2>/dev/null)" != $$ ] || rm -f "$build_pid"
  exit "$rc"
}

build_bg() {
  if [ -x "$bin" ]; then return 0; fi
  if build_running; then
    say "versitygw is being built in the background (pid $(cat "$build_pid"); log: .dev/logs/versitygw-build.log)"
    return 0
  fi
  rm -f "$build_status"
  # Its own session: a Ctrl-C of the make that started it does not stop it.
  local detach=()
  if command -v setsid >/dev/null; then detach=(setsid); fi
  # At the lowest CPU priority: the build only takes the CPU the tests that
  # run meanwhile leave idle (make test's tests that need no S3 server).
  nohup "${detach[@]}" nice -n 19 "$self" build-job </dev/null >/dev/null 2>&1 &
  echo $! >"$build_pid"
  say "building versitygw $VERSITYGW_VERSION in the background (pid $!; log: .dev/logs/versitygw-build.log; scripts/s3server.sh wait)"
}

# report_build says how the background build ended; non-zero when it failed
# (and no other build made the binary since).
report_build() {
  local rc secs
  if [ -f "$build_status" ]; then
    read -r rc secs <"$build_status" || true
    if [ -x "$bin" ]; then
      [ "${rc:-1}" != 0 ] || say "versitygw $VERSITYGW_VERSION built in the background in ${secs:-?}s"
      rm -f "$build_status" # said once
      return 0
    fi
    tail -n 20 "$build_log" >&2 || true
    say "error: the background versitygw build failed (exit ${rc:-?}); see .dev/logs/versitygw-build.log"
    return 1
  fi
  [ -x "$bin" ] || { say "error: .dev/bin/versitygw is missing and no build is running"; return 1; }
}

wait_build() {
  local limit=${1:-900} start=$SECONDS next=30
  [[ $limit =~ ^[0-9]+$ ]] || die "wait: want a number of seconds, got $limit"
  if ! build_running; then
    if [ -x "$bin" ]; then
      [ ! -f "$build_status" ] || report_build
      return 0
    fi
    # A failed background build is reported, not retried (build-bg retries).
    if [ -f "$build_status" ]; then report_build; return; fi
    do_build
    return
  fi
  say "waiting for the background versitygw build (pid $(cat "$build_pid"), up to ${limit}s)"
  while build_running; do
    if [ $((SECONDS - start)) -ge "$limit" ]; then
      die "the versitygw build is still running after ${limit}s (pid $(cat "$build_pid"); log: .dev/logs/versitygw-build.log)"
    fi
    sleep 1
    if [ $((SECONDS - start)) -ge $next ]; then
      say "still waiting: $((SECONDS - start))s, $(compiled) packages compiled"
      next=$((next + 30))
    fi
  done
  report_build
  say "waited $((SECONDS - start))s for it"
}

build() {
  if [ -x "$bin" ]; then
    say "versitygw: .dev/bin/versitygw is built"
    return 0
  fi
  if build_running; then wait_build 900; else do_build; fi
}

server_running() { alive "$server_pid" versitygw; }

# credentials sets ak and sk: the dev server's root credentials, made once.
credentials() {
  mkdir -p "$s3"
  if [ ! -s "$s3/credentials" ]; then
    (
      umask 077
      printf 'ak=kvmesh-dev-%s\nsk=%s\n' "$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')" \
        "$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')" >"$s3/credentials"
    )
  fi
  # shellcheck disable=SC1091
  source "$s3/credentials"
}

# write_env puts the dev server's three lines into .dev/env, replacing the
# ones there and keeping every other line (scripts/devstack.sh's).
write_env() {
  local env="$dev/env" tmp
  tmp=$(mktemp "$dev/env.XXXXXX")
  {
    if [ -f "$env" ]; then grep -v '^export KVMESH_DEV_TIER_' "$env" || true; fi
    echo "export KVMESH_DEV_TIER_URL='http://127.0.0.1:$1/$bucket'"
    echo "export KVMESH_DEV_TIER_ACCESS_KEY='$ak'"
    echo "export KVMESH_DEV_TIER_SECRET_KEY='$sk'"
  } >"$tmp"
  mv "$tmp" "$env"
}

drop_env() {
  local env="$dev/env" tmp
  [ -f "$env" ] && grep -q '^export KVMESH_DEV_TIER_' "$env" || return 0
  tmp=$(mktemp "$dev/env.XXXXXX")
  grep -v '^export KVMESH_DEV_TIER_' "$env" >"$tmp" || true
  mv "$tmp" "$env"
}

# create_bucket PORT makes the bucket with a signed CreateBucket (curl signs
# it; versitygw wants x-amz-content-sha256, which curl does not add itself).
# An existing bucket (409 BucketAlreadyOwnedByYou) is fine.
create_bucket() {
  local code
  code=$(curl -s -o "$s3/create-bucket.xml" -w '%{http_code}' -X PUT \
    --aws-sigv4 "aws:amz:$region:s3" --user "$ak:$sk" \
    -H 'x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855' \
    "http://127.0.0.1:$1/$bucket") || true
  case $code in
    200) say "bucket $bucket created" ;;
    409) grep -q BucketAlreadyOwnedByYou "$s3/create-bucket.xml" ||
      die "CreateBucket $bucket: $(cat "$s3/create-bucket.xml")" ;;
    *) die "CreateBucket $bucket answered ${code:-nothing}: $(cat "$s3/create-bucket.xml" 2>/dev/null)" ;;
  esac
  rm -f "$s3/create-bucket.xml"
}

up() {
  command -v curl >/dev/null || die "curl is needed"
  build
  credentials
  if server_running; then
    local p
    p=$(cat "$s3/port")
    say "versitygw already running on 127.0.0.1:$p (pid $(cat "$server_pid"))"
    write_env "$p"
    return 0
  fi
  in_use "$port" && die "port $port is in use; stop what listens there or set KVMESH_DEV_S3_PORT"
  mkdir -p "$s3/data" "$s3/meta"
  # The root credentials go in through the environment, not the command line.
  ROOT_ACCESS_KEY_ID=$ak ROOT_SECRET_ACCESS_KEY=$sk nohup "$bin" \
    --port "127.0.0.1:$port" --region "$region" --keep-alive --quiet \
    posix --sidecar "$s3/meta" "$s3/data" >"$dev/logs/versitygw.log" 2>&1 &
  echo $! >"$server_pid"
  echo "$port" >"$s3/port"
  # Ready when it answers HTTP at all (403 to an unsigned request).
  wait_for 30 curl -s -o /dev/null "http://127.0.0.1:$port/" ||
    die "versitygw did not come up on 127.0.0.1:$port; see .dev/logs/versitygw.log"
  create_bucket "$port"
  write_env "$port"
  say "versitygw up on http://127.0.0.1:$port (bucket $bucket, data .dev/s3/data/$bucket); KVMESH_DEV_TIER_* in .dev/env"
}

down() {
  if server_running; then
    local pid
    pid=$(cat "$server_pid")
    kill -TERM "$pid" 2>/dev/null || true
    wait_for 10 bash -c "! kill -0 $pid" || kill -KILL "$pid" 2>/dev/null || true
    say "versitygw stopped"
  fi
  rm -f "$server_pid"
  drop_env
}

status() {
  if [ -x "$bin" ]; then say "built: .dev/bin/versitygw"; elif build_running; then
    say "building (pid $(cat "$build_pid"), $(compiled) packages compiled so far)"
  else say "not built"; fi
  if server_running; then
    say "running on 127.0.0.1:$(cat "$s3/port") (pid $(cat "$server_pid"))"
  else say "not running"; fi
}

case "${1:-}" in
  build) build ;;
  build-bg) build_bg ;;
  build-job) build_job ;;
  wait) wait_build "${2:-900}" ;;
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 build|build-bg|wait [SECONDS]|up|down|status" >&2; exit 2 ;;
esac
