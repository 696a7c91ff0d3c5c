#!/bin/sh
# Installs etcd (Debian's etcd-server, 3.4.x) for the `etcd` coordination backend
# and its tests, without letting the packaged service start: mooncaked and the
# tests run their own etcd on loopback ports with their own data directory.
#
# Usage (as root, Debian 12): sh mooncaked/coord/install_etcd.sh
# Idempotent: does nothing when `etcd` is already on PATH.
set -eu

if command -v etcd >/dev/null 2>&1; then
    echo "etcd already installed: $(command -v etcd)"
    exit 0
fi

# policy-rc.d exit code 101 = "action forbidden": dpkg's maintainer scripts then
# skip starting etcd.service (on 2379/2380) during the install.
policy=/usr/sbin/policy-rc.d
had_policy=0
[ -e "$policy" ] && had_policy=1
if [ "$had_policy" = 0 ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod +x "$policy"
fi
trap '[ "$had_policy" = 0 ] && rm -f "$policy"' EXIT

export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=300 update -qq
apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends etcd-server etcd-client

# If systemd runs here, keep the packaged service stopped and disabled.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemctl disable --now etcd.service >/dev/null 2>&1 || true
fi
etcd --version | head -1
