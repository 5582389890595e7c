#!/bin/sh
# Container entrypoint: point iptables at the flavour (nft or legacy) the
# host already uses, then exec kproxy. Rules written with the other flavour
# would sit in a table the host's own tools and kube-proxy never read.
# Detection, like upstream's iptables-wrapper: count the rules each flavour
# sees; the one with more (kubelet and the CNI create some) wins; nft on a tie.
set -eu
if [ -z "${KPROXY_IPTABLES_MODE:-}" ]; then
  legacy=$( (iptables-legacy-save || true; ip6tables-legacy-save || true) 2>/dev/null | grep -c '^-' || true)
  nft=$( (iptables-nft-save || true; ip6tables-nft-save || true) 2>/dev/null | grep -c '^-' || true)
  if [ "${legacy:-0}" -gt "${nft:-0}" ]; then
    KPROXY_IPTABLES_MODE=legacy
  else
    KPROXY_IPTABLES_MODE=nft
  fi
fi
case "$KPROXY_IPTABLES_MODE" in
  legacy|nft) ;;
  *) echo "kproxy-entrypoint: KPROXY_IPTABLES_MODE must be legacy or nft" >&2; exit 1 ;;
esac
# Debian's iptables alternatives carry -save and -restore as followers.
update-alternatives --set iptables "/usr/sbin/iptables-${KPROXY_IPTABLES_MODE}" >/dev/null
update-alternatives --set ip6tables "/usr/sbin/ip6tables-${KPROXY_IPTABLES_MODE}" >/dev/null
exec /usr/local/bin/kproxy "$@"
