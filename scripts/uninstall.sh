#!/usr/bin/env bash
# Undoes scripts/install.sh: stops and disables the service, removes the unit, the venv and
# docs (/opt/loadmesh), the agent's state (/var/lib/loadmesh) and its system user. The
# configuration and the gossip key in /etc/loadmesh stay, owned by root from now on, so a
# later install finds them again.
#
# Usage: scripts/uninstall.sh                      as root, on the host
#        DESTDIR=/tmp/stage scripts/uninstall.sh   from a staging tree
set -euo pipefail

destdir=${DESTDIR:-}
prefix=/opt/loadmesh
confdir=/etc/loadmesh
unit=/etc/systemd/system/loadmesh.service
sysusers=/etc/sysusers.d/loadmesh.conf

say() { echo "uninstall: $*" >&2; }
die() { echo "uninstall: $*" >&2; exit 1; }

[ -n "$destdir" ] || [ "$(id -u)" -eq 0 ] || die "run as root (or set DESTDIR)"
[ -z "$destdir" ] || [ "${destdir#/}" != "$destdir" ] || die "DESTDIR must be an absolute path"

if [ -z "$destdir" ] && [ -d /run/systemd/system ] && [ -e "$unit" ]; then
  systemctl disable --now loadmesh.service
fi
rm -f "$destdir$unit"
if [ -z "$destdir" ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
fi
rm -rf "$destdir$prefix" "$destdir/var/lib/loadmesh"
rm -f "$destdir$sysusers"
if [ -z "$destdir" ] && id loadmesh >/dev/null 2>&1; then
  [ ! -e "$confdir/gossip.key" ] || chown root:root "$confdir/gossip.key"
  userdel loadmesh
fi
say "removed; kept $destdir$confdir (configuration and gossip key)"
