#!/usr/bin/env bash
# Installs the Debian 12 packages kvtier needs to build, test and benchmark, skipping those
# already present. Uses sudo when not root. Safe to run repeatedly. When another apt or dpkg
# holds the dpkg lock (unattended-upgrades on a fresh machine), waits for it (up to
# KVT_APT_LOCK_TIMEOUT seconds, default 600) instead of failing.
set -euo pipefail
pkgs=(build-essential cmake pkg-config clang libclang-rt-14-dev
      libsqlite3-dev libssl-dev libxxhash-dev libcjson-dev liburing-dev
      python3 python3-numpy python3-pytest python3-setuptools python3-pip fio sqlite3
      libhiredis-dev redis-server redis-tools cflow)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}" >&2
timeout=${KVT_APT_LOCK_TIMEOUT:-600}
# apt's own wait covers the dpkg lock of `install`; `update` (APT 2.6) does not wait for the
# lists lock, so it is retried while another apt holds that lock.
lock=(-o "DPkg::Lock::Timeout=$timeout")
deadline=$((SECONDS + timeout))
until err=$($SUDO env DEBIAN_FRONTEND=noninteractive apt-get "${lock[@]}" update -qq 2>&1); do
  if ! grep -qi "lock" <<<"$err" || [ "$SECONDS" -ge "$deadline" ]; then
    echo "$err" >&2
    exit 100
  fi
  echo "install-deps: waiting for the apt lock" >&2
  sleep 5
done
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get "${lock[@]}" install -y -qq \
  --no-install-recommends "${missing[@]}"
