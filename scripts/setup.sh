#!/usr/bin/env bash
# One-command setup for a fresh Debian 12 host: system packages, kernel headers for BCC,
# tracefs, and the project's virtual environment. Safe to run again: every step checks
# first and does nothing when its work is already done, so `make run` and `make test`
# can call it each time at almost no cost.
set -euo pipefail
# Usage: setup.sh [--bench]   (--bench also installs nginx, wrk and libfaketime for
# scripts/bench_*.py)

here=$(cd "$(dirname "$0")/.." && pwd)
venv="$here/.venv"

die() { echo "setup: $*" >&2; exit 1; }
say() { echo "setup: $*" >&2; }

[ "$(uname -s)" = Linux ] || die "loadmesh needs Linux (eBPF, network namespaces); this is $(uname -s)"
[ "$(id -u)" -eq 0 ] || die "run as root: it installs Debian packages, links kernel headers and mounts tracefs"
command -v apt-get >/dev/null || die "no apt-get: this script knows Debian and its derivatives only"

# Debian packages. bcc comes from Debian (python3-bpfcc), not PyPI: the PyPI "bcc" is
# an unrelated project. The rest are what the agent and its tests call.
packages=(
  python3 python3-venv python3-dev python3-bpfcc bpfcc-tools linux-headers-amd64
  iproute2 nftables curl procps
  # the operations tests: promtool and a Prometheus server, systemd-analyze, and libseccomp
  # to apply the unit's system call filter where systemd is not PID 1
  prometheus systemd python3-seccomp
)
[ "${1:-}" = --bench ] && packages+=(nginx-light wrk libfaketime)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The tests start their own Prometheus; one that Debian's package enabled and started
  # on :9090 would only be a surprise on a developer's host.
  if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
fi

# BCC compiles the probes at run time against kernel headers. A kernel without its own
# (no /lib/modules/<release>/build, no CONFIG_IKHEADERS) gets Debian's current headers,
# which are enough for the tracepoint and TC programs loadmesh uses.
kdir="/lib/modules/$(uname -r)"
if [ ! -e "$kdir/build/include" ] && [ ! -e /sys/kernel/kheaders.tar.xz ]; then
  hdr_pkg=$(dpkg-query -W -f='${Depends}' linux-headers-amd64 | grep -o 'linux-headers-[^ ,]*-amd64' | head -n1)
  [ -n "$hdr_pkg" ] || die "cannot tell which headers linux-headers-amd64 installed"
  arch_dir="/usr/src/$hdr_pkg"
  common_dir="/usr/src/${hdr_pkg%-amd64}-common"
  [ -d "$arch_dir" ] && [ -d "$common_dir" ] || die "kernel headers missing: $arch_dir, $common_dir"
  say "linking kernel headers $arch_dir for $(uname -r)"
  mkdir -p "$kdir"
  ln -sfn "$arch_dir" "$kdir/build"
  ln -sfn "$common_dir" "$kdir/source"
fi

if [ -d /sys/kernel/tracing ] && ! mountpoint -q /sys/kernel/tracing; then
  say "mounting tracefs on /sys/kernel/tracing"
  mount -t tracefs nodev /sys/kernel/tracing
fi

# The venv comes from Debian's interpreter, with system site-packages, because that is
# the only Python that can import Debian's bcc module.
if [ ! -x "$venv/bin/python" ] || [ "$(readlink -f "$venv/bin/python")" != "$(readlink -f /usr/bin/python3)" ]; then
  say "creating $venv from /usr/bin/python3"
  rm -rf "$venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi

stamp="$venv/.installed"
if [ ! -e "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ]; then
  say "installing loadmesh (editable) with its test extras"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$here[test]"
  touch "$stamp"
fi

"$venv/bin/python" -c 'import bcc' 2>/dev/null || die "the venv cannot import bcc (python3-bpfcc)"
