#!/usr/bin/env bash
# Measurement spike for an nftables backend; results and discussion are in
# docs/nftables-spike.md.
#
# Generates, for N services x E endpoints, nft rulesets in four candidate
# layouts and times `nft -f` inside a throwaway network namespace:
#   A  service vmap -> per-service chain -> numgen vmap -> per-endpoint chains
#   B  service vmap -> per-service chain with an inline numgen dnat map
#   C  service vmap -> per-service chain -> numgen lookup in a named map per
#      service, so replacing an endpoint is an element update
#   D  service vmap -> a chain shared by all services with the same endpoint
#      count -> one endpoint map keyed by service address . port . slot, so
#      the number of rules does not grow with the number of services
# The files are written the way knftables writes a transaction: one command
# per line, every non-base chain added and flushed before its rules.
# Nothing here sends a packet; the rules live only in the namespace.
set -euo pipefail

prog=${0##*/}
endpoints=10
runs=5
layouts="A B C D"
keep=""
scales=()

usage() {
	cat <<EOF
Usage: $prog [options] [SERVICES ...]

Times nft rulesets for SERVICES services (default: 1000 10000) with
ENDPOINTS endpoints each in four layouts (A: per-endpoint chains,
B: inline dnat map, C: named endpoint map per service, D: one endpoint map
and chains shared per endpoint count), inside a network
namespace that is removed on exit. Needs root; installs nftables with
apt-get when nft is missing. Prints a Markdown table.

Options:
  -e, --endpoints N   endpoints per service (default $endpoints)
  -r, --runs N        timed runs of each small transaction; the median is
                      reported (default $runs)
  -l, --layouts LIST  layouts to measure, e.g. "A,C" (default A,B,C,D)
  -k, --keep DIR      write the generated files and results to DIR and keep
                      them (default: a temporary directory, removed on exit)
  -h, --help          show this help

Columns: file = lines of the full transaction; list = lines of
'nft list ruleset'; load = full transaction into an empty namespace;
resync = the same transaction again over the loaded table (a restart that
does not flush the table first); noop = 'add table' alone (nft's fixed cost
at this size); change = one endpoint replaced, smallest transaction the
layout allows; count = an 11th endpoint added (layouts C and D, where it
differs from a change: C rewrites the rule's 'mod N', D repoints the
service to the shared chain for 11); list-s / json-s = 'nft list ruleset' / 'nft -j list
ruleset' wall time.
EOF
}

die() {
	echo "$prog: $*" >&2
	exit 1
}

is_uint() {
	[[ $1 =~ ^[1-9][0-9]*$ ]]
}

while (($# > 0)); do
	case $1 in
	-h | --help)
		usage
		exit 0
		;;
	-e | --endpoints)
		(($# >= 2)) || die "$1 needs a value"
		endpoints=$2
		shift 2
		;;
	-r | --runs)
		(($# >= 2)) || die "$1 needs a value"
		runs=$2
		shift 2
		;;
	-l | --layouts)
		(($# >= 2)) || die "$1 needs a value"
		layouts=${2//,/ }
		shift 2
		;;
	-k | --keep)
		(($# >= 2)) || die "$1 needs a value"
		keep=$2
		shift 2
		;;
	-*) die "unknown option $1 (see --help)" ;;
	*)
		scales+=("$1")
		shift
		;;
	esac
done
((${#scales[@]} > 0)) || scales=(1000 10000)
for n in "${scales[@]}"; do
	is_uint "$n" || die "service count must be a positive integer: $n"
done
is_uint "$endpoints" || die "--endpoints must be a positive integer"
is_uint "$runs" || die "--runs must be a positive integer"
((endpoints < 255)) || die "--endpoints must be below 255"
for l in $layouts; do
	[[ $l == [ABCD] ]] || die "unknown layout $l (A, B, C or D)"
done

((EUID == 0)) || die "needs root (network namespaces and nftables)"

if ! command -v nft >/dev/null 2>&1; then
	echo "$prog: nft not found, installing nftables with apt-get" >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null ||
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null; } ||
		die "could not install nftables"
fi
command -v ip >/dev/null 2>&1 || die "ip (iproute2) not found"

ns="nft-spike-$$"
work=""
cleanup() {
	ip netns delete "$ns" 2>/dev/null || true
	if [[ -z $keep && -n $work ]]; then
		rm -rf "$work"
	fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ -n $keep ]]; then
	mkdir -p "$keep"
	work=$keep
else
	work=$(mktemp -d "${TMPDIR:-/tmp}/nft-spike.XXXXXX")
fi
ip netns add "$ns"

# gen LAYOUT SERVICES WHAT writes one transaction to stdout. WHAT is
# full (the whole table), noop, fwd/back (endpoint 3 of service N/2 replaced
# by 10.244.255.1 and back), cfwd/cback (layouts C and D: an 11th endpoint
# added and removed again).
gen() {
	awk -v layout="$1" -v n="$2" -v what="$3" -v e="$endpoints" '
	function ip(a) { return "10.96." int(a / 256) "." (a % 256) }
	function epaddr(a) { return "10.244." int(a / 256) "." (a % 256) }
	# Endpoint j of service i: address index 1..65000, wrapping (two services
	# may share a pod address, as when two services select the same pods).
	function epidx(i, j) { return ((i * e + j) % 65000) + 1 }
	function chain(name) { print "add chain " T " " name; print "flush chain " T " " name }
	# The endpoint list of service i with endpoint slot s replaced by index r
	# (s < 0: none replaced); cnt endpoints.
	function eplist_vmap(i, s, r, cnt,   j, a, out) {
		out = ""
		for (j = 0; j < cnt; j++) {
			a = (j == s) ? r : epidx(i, j)
			out = out (j ? ", " : "") j " : goto ep-" i "-" a
		}
		return out
	}
	function eplist_map(i, s, r, cnt,   j, a, out) {
		out = ""
		for (j = 0; j < cnt; j++) {
			a = (j == s) ? r : epidx(i, j)
			out = out (j ? ", " : "") j " : " epaddr(a) " . 8080"
		}
		return out
	}
	function epchain(i, a) {
		chain("ep-" i "-" a)
		print "add rule " T " ep-" i "-" a " ip saddr " epaddr(a) " meta mark set meta mark | 0x4000"
		print "add rule " T " ep-" i "-" a " meta l4proto tcp dnat to " epaddr(a) ":8080"
	}
	function svcrule(i, s, r, cnt) {
		if (layout == "A")
			print "add rule " T " svc-" i " numgen random mod " cnt " vmap { " eplist_vmap(i, s, r, cnt) " }"
		else if (layout == "B")
			print "add rule " T " svc-" i " meta l4proto tcp dnat ip addr . port to numgen random mod " cnt " map { " eplist_map(i, s, r, cnt) " }"
		else
			print "add rule " T " svc-" i " meta l4proto tcp dnat ip addr . port to numgen random mod " cnt " map @svc-" i "-eps"
	}
	BEGIN {
		T = "ip kspike"
		newep = 65281              # 10.244.255.1, outside the generated range
		t = int(n / 2); slot = 3 % e  # the service and slot a change touches
		nodeports = (n < 2000) ? n : 2000  # services 0..nodeports-1 have one
		if (what == "noop") { print "add table " T; exit }
		if (what == "fwd" || what == "back") {
			from = (what == "fwd") ? epidx(t, slot) : newep
			to = (what == "fwd") ? newep : epidx(t, slot)
			if (layout == "D") {
				print "delete element " T " endpoints { " ip(t + 1) " . 80 . " slot " }"
				print "add element " T " endpoints { " ip(t + 1) " . 80 . " slot " : " epaddr(to) " . 8080 }"
				if (t < nodeports) {
					print "delete element " T " nodeport-endpoints { " 30000 + t " . " slot " }"
					print "add element " T " nodeport-endpoints { " 30000 + t " . " slot " : " epaddr(to) " . 8080 }"
				}
				exit
			}
			if (layout == "C") {
				print "delete element " T " svc-" t "-eps { " slot " }"
				print "add element " T " svc-" t "-eps { " slot " : " epaddr(to) " . 8080 }"
				exit
			}
			if (layout == "A") epchain(t, to)
			chain("svc-" t)
			svcrule(t, slot, to, e)
			if (layout == "A") {
				print "flush chain " T " ep-" t "-" from
				print "delete chain " T " ep-" t "-" from
			}
			exit
		}
		if (what == "cfwd" && layout == "D") {
			print "add element " T " endpoints { " ip(t + 1) " . 80 . " e " : " epaddr(newep) " . 8080 }"
			print "delete element " T " service-ips { " ip(t + 1) " . tcp . 80 }"
			print "add element " T " service-ips { " ip(t + 1) " . tcp . 80 : goto pick-tcp-" e + 1 " }"
			exit
		}
		if (what == "cback" && layout == "D") {
			print "delete element " T " service-ips { " ip(t + 1) " . tcp . 80 }"
			print "add element " T " service-ips { " ip(t + 1) " . tcp . 80 : goto pick-tcp-" e " }"
			print "delete element " T " endpoints { " ip(t + 1) " . 80 . " e " }"
			exit
		}
		if (what == "cfwd") {
			chain("svc-" t)
			svcrule(t, -1, 0, e + 1)
			print "add element " T " svc-" t "-eps { " e " : " epaddr(newep) " . 8080 }"
			exit
		}
		if (what == "cback") {
			chain("svc-" t)
			svcrule(t, -1, 0, e)
			print "delete element " T " svc-" t "-eps { " e " }"
			exit
		}

		# Full transaction.
		print "add table " T
		print "add chain " T " nat-prerouting { type nat hook prerouting priority dstnat ; }"
		print "add chain " T " nat-output { type nat hook output priority -100 ; }"
		print "add chain " T " nat-postrouting { type nat hook postrouting priority srcnat ; }"
		print "add chain " T " filter-input { type filter hook input priority filter ; }"
		print "add chain " T " filter-forward { type filter hook forward priority filter ; }"
		print "add chain " T " filter-output { type filter hook output priority filter ; }"
		print "add set " T " cluster-ips { type ipv4_addr ; }"
		print "add map " T " service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }"
		print "add map " T " service-nodeports { type inet_proto . inet_service : verdict ; }"
		print "add map " T " no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict ; }"
		print "add map " T " no-endpoint-nodeports { type inet_proto . inet_service : verdict ; }"
		print "add set " T " hairpin { type ipv4_addr . ipv4_addr . inet_proto . inet_service ; }"
		chain("services"); chain("masquerading"); chain("endpoints-check"); chain("reject-chain")
		print "add rule " T " nat-prerouting jump services"
		print "add rule " T " nat-output jump services"
		print "add rule " T " nat-postrouting jump masquerading"
		print "add rule " T " filter-input ct state new jump endpoints-check"
		print "add rule " T " filter-forward ct state new jump endpoints-check"
		print "add rule " T " filter-output ct state new jump endpoints-check"
		print "add rule " T " reject-chain reject"
		print "add rule " T " endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services"
		print "add rule " T " endpoints-check fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @no-endpoint-nodeports"
		print "add rule " T " masquerading meta mark & 0x4000 != 0 meta mark set meta mark ^ 0x4000 masquerade fully-random"
		if (layout != "A")
			print "add rule " T " masquerading ct status dnat ip saddr . ip daddr . meta l4proto . th dport @hairpin masquerade fully-random"
		print "add rule " T " services ip daddr @cluster-ips ip saddr != 10.244.0.0/16 meta mark set meta mark | 0x4000"
		print "add rule " T " services ip daddr . meta l4proto . th dport vmap @service-ips"
		print "add rule " T " services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports"
		if (layout == "D") {
			# One chain per endpoint count in use (here e, and e+1 for the
			# count change); the key is the packet destination plus a slot.
			print "add map " T " endpoints { typeof ip daddr . tcp dport . numgen random mod " e " : ip daddr . tcp dport ; }"
			print "add map " T " nodeport-endpoints { typeof tcp dport . numgen random mod " e " : ip daddr . tcp dport ; }"
			for (k = e; k <= e + 1; k++) {
				chain("pick-tcp-" k)
				print "add rule " T " pick-tcp-" k " meta l4proto tcp dnat ip to ip daddr . tcp dport . numgen random mod " k " map @endpoints"
				chain("nodeport-pick-tcp-" k)
				print "add rule " T " nodeport-pick-tcp-" k " meta mark set meta mark | 0x4000"
				print "add rule " T " nodeport-pick-tcp-" k " meta l4proto tcp dnat ip to tcp dport . numgen random mod " k " map @nodeport-endpoints"
			}
		}

		for (i = 0; i < n; i++) {
			c = ip(i + 1)
			if (layout == "A")
				for (j = 0; j < e; j++) epchain(i, epidx(i, j))
			if (layout == "C") {
				print "add map " T " svc-" i "-eps { typeof numgen random mod " e " : ip daddr . tcp dport ; }"
				for (j = 0; j < e; j++)
					print "add element " T " svc-" i "-eps { " j " : " epaddr(epidx(i, j)) " . 8080 }"
			}
			if (layout == "D") {
				print "add element " T " cluster-ips { " c " }"
				print "add element " T " service-ips { " c " . tcp . 80 : goto pick-tcp-" e " }"
				for (j = 0; j < e; j++)
					print "add element " T " endpoints { " c " . 80 . " j " : " epaddr(epidx(i, j)) " . 8080 }"
				if (i < nodeports) {
					print "add element " T " service-nodeports { tcp . " 30000 + i " : goto nodeport-pick-tcp-" e " }"
					for (j = 0; j < e; j++)
						print "add element " T " nodeport-endpoints { " 30000 + i " . " j " : " epaddr(epidx(i, j)) " . 8080 }"
				}
			} else {
				chain("svc-" i)
				svcrule(i, -1, 0, e)
				# A map element may only name a chain that already exists.
				print "add element " T " cluster-ips { " c " }"
				print "add element " T " service-ips { " c " . tcp . 80 : goto svc-" i " }"
				if (i < nodeports) {
					chain("ext-" i)
					print "add rule " T " ext-" i " meta mark set meta mark | 0x4000"
					print "add rule " T " ext-" i " goto svc-" i
					print "add element " T " service-nodeports { tcp . " 30000 + i " : goto ext-" i " }"
				}
			}
			# One endpoint in a hundred is on this node (hairpin).
			if (layout != "A" && i % 10 == 0) {
				a = epaddr(epidx(i, 0))
				print "add element " T " hairpin { " a " . " a " . tcp . 8080 }"
			}
		}
		# One service in a hundred has no endpoints (reject); as many node
		# ports have a Local policy and no local endpoint (drop).
		for (k = 0; k < int(n / 100); k++) {
			c = ip(n + k + 1)
			print "add element " T " cluster-ips { " c " }"
			print "add element " T " no-endpoint-services { " c " . tcp . 80 : goto reject-chain }"
			print "add element " T " no-endpoint-nodeports { tcp . " 32000 + k " : drop }"
		}
	}'
}

# ns_time CMD... runs CMD in the namespace and prints its wall time in
# seconds (bash's time keyword, started inside the namespace so that
# `ip netns exec` itself is not counted).
ns_time() {
	local out rc=0
	# shellcheck disable=SC2016 # expanded by the inner bash
	out=$(ip netns exec "$ns" bash -c \
		'TIMEFORMAT=%3R; err=$1; shift; { time "$@" >/dev/null 2>"$err"; } 2>&1' \
		_ "$work/err" "$@") || rc=$?
	if ((rc != 0)); then
		echo "$prog: '$*' failed in the namespace:" >&2
		head -n 20 "$work/err" >&2
		return "$rc"
	fi
	printf '%s\n' "$out"
}

median() {
	sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

ms() {
	awk -v s="$1" 'BEGIN { printf "%.0f", s * 1000 }'
}

# alternate NAME_FWD NAME_BACK times RUNS transactions that alternate
# forward and back, leaves the table as it was, and prints the median (ms).
alternate() {
	local fwd=$1 back=$2 i s
	for ((i = 0; i < runs; i++)); do
		if ((i % 2 == 0)); then
			s=$(ns_time nft -f "$fwd")
		else
			s=$(ns_time nft -f "$back")
		fi
		ms "$s"
		echo
	done >"$work/samples"
	if ((runs % 2 == 1)); then
		ns_time nft -f "$back" >/dev/null
	fi
	median <"$work/samples"
}

results=$work/results.md
{
	echo "nft: $(nft --version 2>/dev/null | head -n 1); kernel: $(uname -r); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
	echo
	echo "| services | layout | file lines | list lines | load s | resync s | noop ms | change ms | count ms | list s | json s |"
	echo "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
} | tee "$results"

for n in "${scales[@]}"; do
	for l in $layouts; do
		f=$work/$l-$n
		gen "$l" "$n" full >"$f-full.nft"
		gen "$l" "$n" noop >"$f-noop.nft"
		gen "$l" "$n" fwd >"$f-fwd.nft"
		gen "$l" "$n" back >"$f-back.nft"
		if [[ $l == [CD] ]]; then
			gen "$l" "$n" cfwd >"$f-cfwd.nft"
			gen "$l" "$n" cback >"$f-cback.nft"
		fi
		ip netns exec "$ns" nft delete table ip kspike 2>/dev/null || true

		load=$(ns_time nft -f "$f-full.nft")
		resync=$(ns_time nft -f "$f-full.nft")
		for ((i = 0; i < runs; i++)); do
			ms "$(ns_time nft -f "$f-noop.nft")"
			echo
		done >"$work/samples"
		noop=$(median <"$work/samples")
		change=$(alternate "$f-fwd.nft" "$f-back.nft")
		count="-"
		if [[ $l == [CD] ]]; then
			count=$(alternate "$f-cfwd.nft" "$f-cback.nft")
		fi
		list=$(ns_time nft list ruleset)
		json=$(ns_time nft -j list ruleset)
		lines=$(ip netns exec "$ns" nft list ruleset | wc -l)
		flines=$(wc -l <"$f-full.nft")
		ip netns exec "$ns" nft delete table ip kspike
		if [[ -z $keep ]]; then
			rm -f "$f"-*.nft
		fi
		echo "| $n | $l | $flines | $lines | $load | $resync | $noop | $change | $count | $list | $json |" | tee -a "$results"
	done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$results"
