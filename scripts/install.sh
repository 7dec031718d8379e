#!/usr/bin/env bash
# Installs (or upgrades) loadmesh on this host, from this source tree:
#
#   /opt/loadmesh/venv            its own virtual environment (Debian's Python, which is the
#                                 only one that can import Debian's bcc)
#   /opt/loadmesh/doc             README and docs
#   /etc/loadmesh/loadmesh.toml   every key with its default, commented; never overwritten
#   /etc/loadmesh/gossip.key      a new random gossip key (mode 0600) unless one is there
#   /etc/sysusers.d/loadmesh.conf the system user the agent runs as
#   /etc/systemd/system/loadmesh.service
#
# then enables and (re)starts the service when systemd runs. Run it again to upgrade: the
# configuration and the key stay, the package and the unit are replaced, and a running
# agent restarts only once its configuration checks out with the new version.
#
# Usage: scripts/install.sh                          as root, on the host
#        DESTDIR=/tmp/stage scripts/install.sh       into a staging tree: no user is made
#                                                    and nothing outside DESTDIR changes
# Needs python3, python3-venv and python3-bpfcc (scripts/setup.sh installs them), and
# PyPI or a pip cache for loadmesh's dependencies.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
destdir=${DESTDIR:-}
prefix=/opt/loadmesh
confdir=/etc/loadmesh
unit=/etc/systemd/system/loadmesh.service
sysusers=/etc/sysusers.d/loadmesh.conf

say() { echo "install: $*" >&2; }
die() { echo "install: $*" >&2; exit 1; }

[ -n "$destdir" ] || [ "$(id -u)" -eq 0 ] || die "run as root (or set DESTDIR to stage)"
[ -z "$destdir" ] || [ "${destdir#/}" != "$destdir" ] || die "DESTDIR must be an absolute path"

venv=$destdir$prefix/venv
conf=$destdir$confdir/loadmesh.toml
key=$destdir$confdir/gossip.key

# The package: built from a copy, so the source tree gets no build/ or egg-info.
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
cp -r "$here/pyproject.toml" "$here/README.md" "$here/src" "$here/daemon" "$here/probes" "$here/gossip" "$src/"
find "$src" -name __pycache__ -prune -exec rm -rf {} +
say "installing loadmesh into $venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "$src"
# The version number need not move between two trees: replace the package regardless.
"${pip[@]}" --force-reinstall --no-deps "$src"
if [ -n "$destdir" ]; then
  # Scripts and pyvenv.cfg name the staging path; on the host the tree lives at $prefix.
  grep -rlI --null -- "$venv" "$venv/bin" "$venv/pyvenv.cfg" | xargs -0 -r sed -i "s|$venv|$prefix/venv|g"
fi
install -d -m 0755 "$destdir$prefix/doc"
install -m 0644 "$here/README.md" "$here"/docs/*.md "$destdir$prefix/doc/"

# The user: systemd-sysusers where there is one, useradd otherwise.
install -d -m 0755 "$(dirname "$destdir$sysusers")"
echo 'u loadmesh - "loadmesh agent" /var/lib/loadmesh /usr/sbin/nologin' > "$destdir$sysusers"
if [ -z "$destdir" ] && ! id loadmesh >/dev/null 2>&1; then
  if command -v systemd-sysusers >/dev/null; then
    systemd-sysusers "$sysusers"
  else
    useradd --system --home-dir /var/lib/loadmesh --no-create-home --shell /usr/sbin/nologin loadmesh
  fi
fi

install -d -m 0755 "$destdir$confdir"
if [ ! -e "$key" ]; then
  say "generating a gossip key in $key: copy it to every host of the mesh"
  (umask 077; /usr/bin/python3 -c 'import secrets; print(secrets.token_hex(32))' > "$key")
fi
chmod 0600 "$key"
# The agent reads the key as user loadmesh; a staging tree has no such user.
[ -n "$destdir" ] || chown loadmesh:loadmesh "$key"
if [ ! -e "$conf" ]; then
  say "writing the default configuration to $conf"
  # Keys commented out keep their defaults, also those a later version changes; the key
  # file is the one value this script sets.
  { echo "# Installed by loadmesh's scripts/install.sh. Uncomment and change what this host needs;"
    echo "# \`loadmesh config check $confdir/loadmesh.toml\` validates, \`systemctl reload loadmesh\` applies."
    "$venv/bin/python" -I -m loadmesh.daemon config defaults \
      | sed -e 's/^\([a-z_]* = \)/# \1/' -e "s|^# key_file = \"\"|key_file = \"$confdir/gossip.key\"|"
  } > "$conf"
  chmod 0644 "$conf"
else
  say "keeping the existing $conf"
fi
"$venv/bin/python" -I -m loadmesh.daemon config check "$conf" >/dev/null \
  || die "$conf does not pass \`loadmesh config check\` with this version: fix it, then run again"

install -d -m 0755 "$(dirname "$destdir$unit")"
install -m 0644 "$here/systemd/loadmesh.service" "$destdir$unit"

if [ -n "$destdir" ]; then
  say "staged in $destdir: not enabling or starting the service"
elif [ ! -d /run/systemd/system ]; then
  say "systemd is not running here: not enabling or starting the service"
  say "start the agent with: $prefix/venv/bin/loadmesh agent --config $confdir/loadmesh.toml"
else
  systemctl daemon-reload
  systemctl enable loadmesh.service
  if systemctl is-active --quiet loadmesh.service; then
    say "restarting the running agent on the new version"
    systemctl restart loadmesh.service
  else
    systemctl start loadmesh.service
  fi
  say "loadmesh.service is $(systemctl is-active loadmesh.service)"
fi
