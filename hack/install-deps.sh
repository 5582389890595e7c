#!/usr/bin/env bash
# Installs what kproxy's build and tests need on a Debian machine, skipping
# whatever is already there: iptables (legacy and nft), nftables (the nft
# command of nftables mode), ipset, conntrack, iproute2, and Go modules.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v iptables-restore >/dev/null 2>&1 || need+=(iptables)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v ipset >/dev/null 2>&1 || need+=(ipset)
command -v conntrack >/dev/null 2>&1 || need+=(conntrack)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# flock and nsenter (the local cluster)
{ command -v flock && command -v nsenter; } >/dev/null 2>&1 || need+=(util-linux)
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install-deps: need root to install: ${need[*]}" >&2
    exit 1
  fi
  echo "install-deps: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if ! command -v go >/dev/null 2>&1 && [ -x /usr/local/go/bin/go ]; then
  export PATH="/usr/local/go/bin:$PATH"
fi
command -v go >/dev/null 2>&1 || { echo "install-deps: Go is not installed" >&2; exit 1; }
go mod download
(cd test && go mod download)
