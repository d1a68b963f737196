#!/usr/bin/env bash
# Installs the Debian 12 packages kvtier needs to build, test and benchmark, skipping those
# already present. Uses sudo when not root. Safe to run repeatedly.
set -euo pipefail
pkgs=(build-essential cmake pkg-config clang libclang-rt-14-dev
      libsqlite3-dev libssl-dev libxxhash-dev libcjson-dev liburing-dev
      python3 python3-numpy python3-pytest fio sqlite3
      libhiredis-dev redis-server redis-tools)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}" >&2
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
