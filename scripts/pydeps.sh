#!/usr/bin/env bash
# pydeps.sh — the Debian Python packages the vLLM connector's tests need
# (connectors/vllm): python3-confluent-kafka, python3-numpy, python3-pytest
# and python3-torch, plus python3-pip, python3-setuptools, python3-wheel and
# python3-venv (the plugin test builds the connector's wheel and installs it
# into a virtual environment), for Debian's /usr/bin/python3 (a pyenv or
# virtualenv python3 on PATH does not see them).
#
#   scripts/pydeps.sh   install the missing ones with apt-get (as root), or
#                       print the apt-get command and fail (not root)
#
# Like devstack.sh's apt_install: --no-install-recommends, quiet, the log
# in .dev/apt-python.log, and an apt-get update only when the first install
# fails (a clean machine's empty package lists).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dev="$root/.dev"
python=/usr/bin/python3
# module:package, one per Debian package.
wanted="confluent_kafka:python3-confluent-kafka numpy:python3-numpy pytest:python3-pytest torch:python3-torch pip:python3-pip setuptools:python3-setuptools wheel:python3-wheel ensurepip:python3-venv"

say() { printf 'pydeps: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# missing prints the packages whose module $python cannot import.
missing() {
  local m pkgs=()
  for m in $wanted; do
    if ! [ -x "$python" ] || ! "$python" -c "import ${m%%:*}" >/dev/null 2>&1; then
      pkgs+=("${m#*:}")
    fi
  done
  echo "${pkgs[*]}"
}

pkgs=$(missing)
[ -z "$pkgs" ] && exit 0
cmd="apt-get install -y --no-install-recommends $pkgs"
[ "$(id -u)" = 0 ] || die "$python cannot import the connector tests' modules; install them with: sudo $cmd"
mkdir -p "$dev"
say "installing $pkgs with apt-get (log in $dev/apt-python.log)"
# shellcheck disable=SC2086 # $pkgs is a list of package names
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >"$dev/apt-python.log" 2>&1; then
  apt-get update -qq >>"$dev/apt-python.log" 2>&1 || true
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >>"$dev/apt-python.log" 2>&1 ||
    die "$cmd failed; see $dev/apt-python.log"
fi
pkgs=$(missing)
[ -z "$pkgs" ] || die "$python still cannot import the modules of $pkgs after installing them; see $dev/apt-python.log"
