#!/usr/bin/env bash
# ipvs-vm.sh: run a program (normally a Go test binary) inside a throwaway qemu
# VM booted from Debian's kernel, which has IPVS, dummy, veth, ipset and the
# netfilter modules this machine's own kernel lacks.
#
# Usage, as go test's exec wrapper:
#
#   go test -exec "$PWD/hack/ipvs-vm.sh" ./pkg/ipvs/
#   hack/ipvs-vm.sh ./some.test -test.run TestX -test.v   # directly
#
# go calls the script with the test binary and its arguments. The script
# boots a VM whose initramfs holds busybox, the kernel modules, iptables
# (nft and legacy), ipset, conntrack, iproute2, ipvsadm, kmod and the
# binary, runs the binary there with the same arguments and KPROXY_IN_VM=1
# (tests that need the VM skip unless it is set, so plain `go test` on the
# host passes), streams its output to stdout and exits with the binary's exit
# code. The guest's working directory is the caller's (the package directory
# under go test) holding a copy of its testdata/, if any; nothing else of the
# host's file system is there. The IPVS schedulers, dummy, veth, bridge,
# sctp, xfrm_user, conntrack, nat, nf_tables, ip_set and the xt matches and
# targets kube-proxy's rules use are loaded at boot; every other netfilter
# and bridge module is shipped for the kernel to load on demand.
#
# Measured on a 2-core machine under TCG: a warm run is about 4 s from launch
# to exit (the guest reaches /init in about 2.5 s); a cold one (kernel download,
# initramfs build, KVM probe) about 6 s more.
#
# The VM has no network card (-nic none): every packet a test sends stays in
# the guest. Each run uses its own scratch directory, so `go test` may run
# packages in parallel; downloads and builds are serialized by a lock.
#
# Host needs (installed with apt-get when missing, as root): qemu-system-x86,
# busybox-static, cpio, kmod, and the tools copied into the guest: iptables,
# ipset, conntrack, iproute2, ipvsadm, netbase. The kernel package is fetched with
# `apt-get download` and unpacked, never installed.
#
# Environment:
#   KPROXY_VM_CACHE      cache directory (default <repo>/test/_cache/vm):
#                        unpacked kernel, base initramfs, KVM probe result
#   KPROXY_VM_TIMEOUT    seconds the whole VM run may take (default 600, or
#                        the binary's -test.timeout plus 60 s when larger)
#   KPROXY_VM_BOOT_TIMEOUT  seconds until the guest's /init must have started
#                        (default 120 under TCG, 30 when trying KVM)
#   KPROXY_VM_ACCEL      auto (default), tcg or kvm. auto tries KVM when
#                        /dev/kvm is usable and falls back to TCG if the
#                        guest does not boot; the result is remembered per
#                        host kernel in the cache
#   KPROXY_VM_MEM        guest memory in MB (default 1024)
#   KPROXY_VM_CPUS       guest CPUs (default 2)
#   KPROXY_VM_KERNEL_PKG Debian kernel meta package (default
#                        linux-image-cloud-amd64; linux-image-amd64 works too)
#   KPROXY_VM_IPTABLES   nft or legacy: what plain iptables, ip6tables and
#                        their -save/-restore mean in the guest (default: the
#                        host's choice, else nft). The explicit -nft and
#                        -legacy names always exist.
#   KPROXY_VM_PASSENV    extra variable names to pass into the guest.
#                        KPROXY_* (except KPROXY_VM_*) and GOTRACEBACK,
#                        GODEBUG, GOMAXPROCS, GOGC, GOMEMLIMIT always pass.
#   KPROXY_VM_VERBOSE=1  show preparation steps and kernel messages
#   KPROXY_VM_KEEP=1     keep the scratch directory (printed on exit)
#
# Exit status: the binary's; 124 when the run timed out; 125 when the VM
# could not be prepared or stopped without reporting an exit code.
set -euo pipefail

prog=ipvs-vm
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { if [ "${KPROXY_VM_VERBOSE:-0}" = 1 ]; then echo "$prog: $*" >&2; fi; }
die() { echo "$prog: $*" >&2; exit 125; }

[ "$#" -ge 1 ] || die "usage: $0 BINARY [ARGS...]"
bin=$1
shift
if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then die "$bin: not an executable file"; fi
bin=$(readlink -f "$bin")

cache=${KPROXY_VM_CACHE:-$repo/test/_cache/vm}
mem=${KPROXY_VM_MEM:-1024}
cpus=${KPROXY_VM_CPUS:-2}
kernel_meta=${KPROXY_VM_KERNEL_PKG:-linux-image-cloud-amd64}
accel_mode=${KPROXY_VM_ACCEL:-auto}
case "$accel_mode" in auto | tcg | kvm) ;; *) die "KPROXY_VM_ACCEL must be auto, tcg or kvm" ;; esac

# Modules loaded at boot (those this kernel has). Every other netfilter
# module is shipped too, for the kernel to load on demand.
boot_modules=(
  ip_vs ip_vs_rr ip_vs_wrr ip_vs_lc ip_vs_wlc ip_vs_sh ip_vs_dh ip_vs_mh
  dummy veth bridge sctp xfrm_user
  nf_conntrack nf_conntrack_netlink nf_nat nf_tables nft_compat nft_chain_nat
  nf_reject_ipv4 nf_reject_ipv6
  ip_set ip_set_hash_ip ip_set_hash_ipport ip_set_hash_ipportip
  ip_set_hash_ipportnet ip_set_hash_net ip_set_hash_netport ip_set_bitmap_port
  xt_set xt_ipvs xt_addrtype xt_comment xt_mark xt_conntrack xt_MASQUERADE
  xt_nat xt_statistic xt_recent xt_multiport xt_tcpudp ipt_REJECT ip6t_REJECT
  iptable_nat iptable_filter iptable_mangle
  ip6table_nat ip6table_filter ip6table_mangle
)
# Module directories shipped whole (with their dependency closure).
module_dirs=(net/netfilter net/ipv4/netfilter net/ipv6/netfilter net/bridge)
# Host packages: the tools this script runs, and those copied into the guest.
host_packages=(qemu-system-x86 busybox-static cpio kmod iptables ipset conntrack iproute2 ipvsadm netbase)

# ---------------------------------------------------------------- helpers

pkg_installed() {
  [ "$(dpkg-query -W -f '${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

# apt_updated runs apt-get update at most once per invocation.
apt_updated=0
apt_update() {
  [ "$apt_updated" = 0 ] || return 0
  apt_updated=1
  log "apt-get update"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq -o DPkg::Lock::Timeout=300 >&2 || return 1
}

ensure_host_packages() {
  local missing=() p
  for p in "${host_packages[@]}"; do
    pkg_installed "$p" || missing+=("$p")
  done
  [ "${#missing[@]}" -gt 0 ] || return 0
  [ "$(id -u)" = 0 ] || die "need root to install: ${missing[*]}"
  echo "$prog: installing ${missing[*]}" >&2
  local install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=300 "${missing[@]}")
  if ! "${install[@]}" >/dev/null; then
    apt_update || die "apt-get update failed"
    "${install[@]}" >/dev/null || die "apt-get install ${missing[*]} failed"
  fi
}

# resolve_kernel sets kpkg and kpkg_version from the meta package's
# dependency. The answer is remembered until the apt lists change.
resolve_kernel() {
  local memo="$cache/resolved-$kernel_meta" line
  if [ -s "$memo" ] && [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -newer "$memo" 2>/dev/null | head -n 1)" ]; then
    read -r kpkg kpkg_version <"$memo"
    [ -n "$kpkg" ] && [ -n "$kpkg_version" ] && return 0
  fi
  # Depends: linux-image-6.1.0-57-cloud-amd64 (= 6.1.192-3)
  line=$(apt-cache show --no-all-versions "$kernel_meta" 2>/dev/null |
    sed -n 's/^Depends: .*\(linux-image-[^ ,]*\) (= \([^)]*\)).*/\1 \2/p' | head -n 1)
  if [ -z "$line" ]; then
    kpkg=$(apt-cache depends "$kernel_meta" 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[^ ]*\)$/\1/p' | head -n 1)
    [ -n "$kpkg" ] || return 1
    kpkg_version=$(apt-cache show --no-all-versions "$kpkg" 2>/dev/null | sed -n 's/^Version: //p' | head -n 1)
    [ -n "$kpkg_version" ] || return 1
  else
    read -r kpkg kpkg_version <<<"$line"
  fi
  echo "$kpkg $kpkg_version" >"$memo.tmp" && mv "$memo.tmp" "$memo"
}

# fetch_kernel makes sure $kdir holds the unpacked package with a
# modules.dep, downloading it if needed.
fetch_kernel() {
  kdir="$cache/kernel/${kpkg}_${kpkg_version}"
  [ -e "$kdir/.done" ] && return 0
  local dl="$cache/download"
  rm -rf "$dl" "$kdir" "$kdir.tmp"
  mkdir -p "$dl"
  echo "$prog: downloading $kpkg $kpkg_version" >&2
  local get=(apt-get download -qq "$kpkg=$kpkg_version")
  # _apt cannot write into the cache directory; download as the caller.
  [ "$(id -u)" != 0 ] || get+=(-o APT::Sandbox::User=root)
  # Quiet unless the retry fails too (prepare_kernel prints the log then).
  (cd "$dl" && "${get[@]}") >>"$scratch/download.log" 2>&1 || return 1
  local deb
  deb=$(find "$dl" -maxdepth 1 -name '*.deb' | head -n 1)
  [ -n "$deb" ] || return 1
  dpkg-deb -x "$deb" "$kdir.tmp" || return 1
  rm -rf "$dl"
  kver=$(find "$kdir.tmp/lib/modules" -mindepth 1 -maxdepth 1 -printf '%f\n' | head -n 1)
  if [ -z "$kver" ] || [ ! -f "$kdir.tmp/boot/vmlinuz-$kver" ]; then die "$kpkg: no kernel or modules inside the package"; fi
  # The package ships no modules.dep.
  depmod -b "$kdir.tmp" "$kver" || return 1
  touch "$kdir.tmp/.done"
  mv "$kdir.tmp" "$kdir"
  # Older kernels are of no further use.
  find "$cache/kernel" -mindepth 1 -maxdepth 1 ! -path "$kdir" -exec rm -rf {} +
}

prepare_kernel() {
  if ! resolve_kernel; then
    apt_update || die "apt-get update failed"
    resolve_kernel || die "cannot resolve $kernel_meta to a versioned package"
  fi
  if ! fetch_kernel; then
    # Debian drops old ABI packages: refresh the lists and resolve again.
    apt_update || die "apt-get update failed"
    rm -f "$cache/resolved-$kernel_meta"
    resolve_kernel || die "cannot resolve $kernel_meta to a versioned package"
    if ! fetch_kernel; then
      cat "$scratch/download.log" >&2
      die "cannot download $kpkg $kpkg_version"
    fi
  fi
  kver=$(find "$kdir/lib/modules" -mindepth 1 -maxdepth 1 -printf '%f\n' | head -n 1)
}

# usr_path maps /lib, /lib64, /bin and /sbin paths to their place under /usr
# (the guest's /lib and friends are links into /usr, as on the host). The
# run archive must never hold a /lib directory: unpacking it would replace
# the base archive's link.
usr_path() {
  case "$1" in
    /lib/* | /lib64/* | /bin/* | /sbin/*) echo "/usr$1" ;;
    *) echo "$1" ;;
  esac
}

# put copies host file $1 to the same path under $stage.
put() {
  local dst
  dst="$stage$(usr_path "$1")"
  [ -e "$dst" ] && [ ! -L "$dst" ] && return 0
  mkdir -p "$(dirname "$dst")"
  rm -f "$dst"
  cp -L "$1" "$dst"
}

# put_libs copies the shared libraries the given ELF files need.
put_libs() {
  local lib
  for lib in $(ldd "$@" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $2 ~ /^\(0x/ {print $1}' | sort -u); do
    put "$lib"
  done
}

# Replaces busybox applets that would shadow the real tool $1 in PATH.
drop_applet() {
  local d
  for d in usr/bin usr/sbin; do
    if [ -L "$stage/$d/$1" ] && [ "$(readlink "$stage/$d/$1")" = /usr/bin/busybox ]; then
      rm -f "$stage/$d/$1"
    fi
  done
}

write_init() {
  cat >"$stage/init" <<'EOF'
#!/bin/sh
# /init of the kproxy test VM, written by hack/ipvs-vm.sh.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=1777 tmpfs /tmp
mkdir -p /run/netns /run/lock
exec </dev/null >/dev/console 2>&1
# No CR before LF: go test reads this output.
stty -F /dev/console -onlcr 2>/dev/null
echo BOOTED >/dev/ttyS1
hostname kproxy-vm
ip link set lo up
. /etc/kproxy-vm/modules
modprobe -a -q $KPROXY_VM_MODULES 2>/dev/null ||
  for m in $KPROXY_VM_MODULES; do modprobe -q "$m" 2>/dev/null; done
# The run's own settings: KPROXY_VM_IPTABLES, KPROXY_VM_DIR, KPROXY_VM_BIN,
# exported variables and the arguments (set --).
. /kproxy-vm/run.sh
for t in iptables ip6tables; do
  for s in "" -save -restore; do
    ln -sf "$t-$KPROXY_VM_IPTABLES$s" "/usr/sbin/$t$s"
  done
done
mkdir -p /root
cd "$KPROXY_VM_DIR" 2>/dev/null || cd /tmp
KPROXY_IN_VM=1 HOME=/root TMPDIR=/tmp "$KPROXY_VM_BIN" "$@"
rc=$?
echo "EXIT=$rc" >/dev/ttyS1
# Keep "reboot: Power down" off the test's output.
echo 0 >/proc/sys/kernel/printk
sync
poweroff -f
EOF
  chmod 0755 "$stage/init"
}

# build_base writes the initramfs without the binary to $base.
build_base() {
  echo "$prog: building the base initramfs for $kver" >&2
  # Left by an interrupted build (this runs under the lock).
  rm -rf "$cache/initrd"/stage.*
  stage=$(mktemp -d "$cache/initrd/stage.XXXXXX")
  local d
  for d in usr/bin usr/sbin usr/lib usr/lib64 proc sys dev run tmp root etc/kproxy-vm kproxy-vm var; do
    mkdir -p "$stage/$d"
  done
  ln -s usr/bin "$stage/bin"
  ln -s usr/sbin "$stage/sbin"
  ln -s usr/lib "$stage/lib"
  ln -s usr/lib64 "$stage/lib64"
  ln -s ../run "$stage/var/run"
  if [ "$(id -u)" = 0 ]; then
    mknod -m 600 "$stage/dev/console" c 5 1
    mknod -m 666 "$stage/dev/null" c 1 3
  fi

  # busybox and its applets.
  cp -L /bin/busybox "$stage/usr/bin/busybox"
  local applet
  while read -r applet; do
    [ -e "$stage/$applet" ] || [ -L "$stage/$applet" ] || ln -s /usr/bin/busybox "$stage/$applet"
  done < <(/bin/busybox --list-full)

  # Real tools, with their libraries.
  local elfs=() f name
  for f in /usr/sbin/xtables-nft-multi /usr/sbin/xtables-legacy-multi /usr/sbin/ipset /usr/sbin/conntrack /usr/sbin/ipvsadm; do
    put "$f"
    elfs+=("$f")
  done
  put /bin/ip
  elfs+=(/bin/ip)
  drop_applet ip
  put /bin/kmod
  elfs+=(/bin/kmod)
  for name in modprobe insmod rmmod lsmod depmod modinfo; do
    drop_applet "$name"
    ln -s ../bin/kmod "$stage/usr/sbin/$name"
  done
  # The xtables-*-multi binaries pick their mode from argv[0].
  while read -r f; do
    name=$(basename "$f")
    drop_applet "$name"
    ln -sf "$(readlink "$f")" "$stage/usr/sbin/$name"
  done < <(find /usr/sbin -maxdepth 1 -type l -lname 'xtables-*-multi')
  for name in iptables ip6tables iptables-save ip6tables-save iptables-restore ip6tables-restore; do
    drop_applet "$name"
  done
  # Matches and targets are plugins loaded at run time.
  for f in /usr/lib/x86_64-linux-gnu/xtables/*.so; do
    put "$f"
    elfs+=("$f")
  done
  put_libs "${elfs[@]}"

  # Configuration files.
  for f in /etc/protocols /etc/services /etc/ethertypes; do
    [ ! -e "$f" ] || put "$f"
  done
  [ ! -d /etc/iproute2 ] || cp -a /etc/iproute2 "$stage/etc/"
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$stage/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$stage/etc/group"
  printf '127.0.0.1 localhost kproxy-vm\n::1 localhost ip6-localhost ip6-loopback\n' >"$stage/etc/hosts"
  printf 'passwd: files\ngroup: files\nhosts: files\n' >"$stage/etc/nsswitch.conf"
  echo kproxy-vm >"$stage/etc/hostname"

  # Modules: the boot list and the netfilter directories, with their
  # dependency closure, then a fresh modules.dep.
  local mods=() present=() m
  for d in "${module_dirs[@]}"; do
    [ ! -d "$kdir/lib/modules/$kver/kernel/$d" ] ||
      while read -r m; do mods+=("$m"); done < <(find "$kdir/lib/modules/$kver/kernel/$d" -name '*.ko*' -printf '%f\n' | sed 's/\.ko.*$//')
  done
  for m in "${boot_modules[@]}"; do
    if modprobe -C /dev/null -d "$kdir" -S "$kver" --show-depends "$m" >/dev/null 2>&1; then
      present+=("$m")
      mods+=("$m")
    fi
  done
  local src
  while read -r src; do
    put_module "$src"
  done < <(modprobe -C /dev/null -d "$kdir" -S "$kver" --show-depends -a "${mods[@]}" 2>/dev/null | awk '$1 == "insmod" {print $2}' | sort -u)
  for f in modules.order modules.builtin modules.builtin.modinfo; do
    [ ! -e "$kdir/lib/modules/$kver/$f" ] || cp "$kdir/lib/modules/$kver/$f" "$stage/usr/lib/modules/$kver/"
  done
  depmod -b "$stage" "$kver"
  echo "KPROXY_VM_MODULES='${present[*]}'" >"$stage/etc/kproxy-vm/modules"

  write_init
  (cd "$stage" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) >"$base.tmp"
  mv "$base.tmp" "$base"
  rm -rf "$stage"
  # Older base images are of no further use.
  find "$cache/initrd" -maxdepth 1 -name 'base-*.cpio' ! -path "$base" -delete
}

# put_module copies a module file of the unpacked kernel to the same place
# under the staging tree.
put_module() {
  local rel=${1#"$kdir"}
  mkdir -p "$stage$(dirname "$rel")"
  cp "$1" "$stage$rel"
}

# base_key names the base initramfs: kernel, this script, and the versions of
# every host package copied into it.
base_key() {
  {
    echo "$kpkg $kpkg_version"
    sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1
    dpkg-query -W -f '${Package} ${Version}\n' busybox-static iptables ipset conntrack iproute2 ipvsadm kmod libc6 netbase \
      libxtables12 libip4tc2 libip6tc2 libnftnl11 libmnl0 libipset13 libnetfilter-conntrack3 libnfnetlink0 2>/dev/null
  } | sha256sum | cut -c1-16
}

# go_seconds converts a Go duration such as 10m0s or 1h30m to whole seconds.
go_seconds() {
  local d=$1 total=0 n unit
  while [[ $d =~ ^([0-9]+)(\.[0-9]+)?(h|m|s)(.*)$ ]]; do
    n=${BASH_REMATCH[1]}
    unit=${BASH_REMATCH[3]}
    d=${BASH_REMATCH[4]}
    case $unit in h) total=$((total + n * 3600)) ;; m) total=$((total + n * 60)) ;; s) total=$((total + n)) ;; esac
  done
  [ -z "$d" ] || return 1
  echo "$total"
}

# shq quotes $1 for a POSIX shell.
shq() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

# ---------------------------------------------------------------- prepare

command -v flock >/dev/null || die "flock (util-linux) is missing"
mkdir -p "$cache/initrd" "$cache/kernel"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/kproxy-vm.XXXXXX")
qemu_pid=
watch_pid=
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
  [ -z "$watch_pid" ] || kill "$watch_pid" 2>/dev/null || true
  [ -z "$qemu_pid" ] || kill "$qemu_pid" 2>/dev/null || true
  if [ "${KPROXY_VM_KEEP:-0}" = 1 ]; then
    echo "$prog: scratch directory kept: $scratch" >&2
  else
    rm -rf "$scratch"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 131' QUIT
trap 'exit 129' HUP

exec 9>"$cache/.lock"
flock 9
ensure_host_packages
prepare_kernel
base="$cache/initrd/base-$kver-$(base_key).cpio"
[ -s "$base" ] || build_base
cp "$kdir/boot/vmlinuz-$kver" "$scratch/vmlinuz"
cp "$base" "$scratch/initrd.cpio"
exec 9>&-

# The run's own archive: the binary, libraries it needs that the base lacks,
# the working directory with its testdata, and run.sh for /init.
run="$scratch/run"
mkdir -p "$run/kproxy-vm"
stage=$run
cp "$bin" "$run/kproxy-vm/"
if ldd "$bin" >/dev/null 2>&1; then
  # (the copy: another run may replace $base once the lock is released)
  base_files=$(cpio -t --quiet <"$scratch/initrd.cpio" 2>/dev/null)
  for lib in $(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $2 ~ /^\(0x/ {print $1}' | sort -u); do
    grep -qxF ".$(usr_path "$lib")" <<<"$base_files" || put "$lib"
  done
fi
# The guest works in the caller's directory (go test: the package's), except
# where /init mounts something over it.
cwd=$(pwd -P)
guest_cwd=$cwd
case "$cwd" in
  / | /tmp | /tmp/* | /run | /run/* | /dev | /dev/* | /proc | /proc/* | /sys | /sys/* | \
    /lib | /lib/* | /lib64 | /lib64/* | /bin | /bin/* | /sbin | /sbin/*) guest_cwd=/kproxy-vm/work ;;
esac
mkdir -p "$run$guest_cwd"
[ ! -d "$cwd/testdata" ] || cp -a "$cwd/testdata" "$run$guest_cwd/"

iptables_mode=${KPROXY_VM_IPTABLES:-}
if [ -z "$iptables_mode" ]; then
  case "$(readlink /etc/alternatives/iptables 2>/dev/null)" in
    *legacy*) iptables_mode=legacy ;;
    *) iptables_mode=nft ;;
  esac
fi
case "$iptables_mode" in nft | legacy) ;; *) die "KPROXY_VM_IPTABLES must be nft or legacy" ;; esac

{
  echo "KPROXY_VM_IPTABLES=$iptables_mode"
  echo "KPROXY_VM_DIR=$(shq "$guest_cwd")"
  echo "KPROXY_VM_BIN=$(shq "/kproxy-vm/$(basename "$bin")")"
  pass=(GOTRACEBACK GODEBUG GOMAXPROCS GOGC GOMEMLIMIT)
  read -r -a extra <<<"${KPROXY_VM_PASSENV:-}"
  pass+=("${extra[@]}")
  while IFS= read -r name; do
    case "$name" in KPROXY_VM_* | KPROXY_IN_VM) ;; KPROXY_*) pass+=("$name") ;; esac
  done < <(compgen -e)
  for name in "${pass[@]}"; do
    [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "KPROXY_VM_PASSENV: bad variable name $name"
    [ -z "${!name+x}" ] || echo "export $name=$(shq "${!name}")"
  done
  printf 'set --'
  for a in "$@"; do printf ' %s' "$(shq "$a")"; done
  echo
} >"$run/kproxy-vm/run.sh"
(cd "$run" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) >>"$scratch/initrd.cpio"

# ---------------------------------------------------------------- run

timeout_s=${KPROXY_VM_TIMEOUT:-}
if [ -z "$timeout_s" ]; then
  timeout_s=600
  for a in "$@"; do
    case "$a" in
      -test.timeout=* | --test.timeout=*)
        if t=$(go_seconds "${a#*=}") && [ "$t" -gt 0 ] && [ $((t + 60)) -gt "$timeout_s" ]; then
          timeout_s=$((t + 60))
        fi
        ;;
    esac
  done
fi
[[ $timeout_s =~ ^[0-9]+$ ]] || die "KPROXY_VM_TIMEOUT must be whole seconds"

if [ "${KPROXY_VM_VERBOSE:-0}" = 1 ]; then
  cmdline="console=ttyS0 loglevel=7"
else
  cmdline="console=ttyS0 quiet loglevel=3"
fi
cmdline+=" panic=-1 oops=panic i8042.noaux i8042.nokbd i8042.nopnp tsc=reliable no_timer_check"

# The KVM probe result is kept per host kernel and qemu build.
accel_memo="$cache/accel-$(uname -r)-$(qemu-system-x86_64 --version | head -n 1 | tr -c 'A-Za-z0-9.\n' _ | cut -c1-60)"
kvm_usable() { [ -r /dev/kvm ] && [ -w /dev/kvm ]; }

# boot_vm ACCEL runs qemu; sets vm_rc and booted (1 when /init started).
boot_vm() {
  local accel=$1 boot_timeout
  local args=(-m "$mem" -smp "$cpus" -nodefaults -no-reboot -display none -vga none -nic none
    -serial stdio -serial "file:$scratch/result.txt"
    -kernel "$scratch/vmlinuz" -initrd "$scratch/initrd.cpio" -append "$cmdline")
  if [ "$accel" = kvm ]; then
    args=(-accel kvm -cpu host "${args[@]}")
    boot_timeout=${KPROXY_VM_BOOT_TIMEOUT:-30}
  else
    args=(-accel "tcg,thread=multi" -cpu max "${args[@]}")
    boot_timeout=${KPROXY_VM_BOOT_TIMEOUT:-120}
  fi
  : >"$scratch/result.txt"
  rm -f "$scratch/boot-timeout"
  log "qemu ($accel): ${args[*]}"
  timeout -k 10 "$timeout_s" qemu-system-x86_64 "${args[@]}" </dev/null 2>"$scratch/qemu.err" &
  qemu_pid=$!
  # Watchdog: /init writes BOOTED to the second serial port first, and the
  # guest powers off right after writing EXIT=.
  (
    waited=0
    while kill -0 "$qemu_pid" 2>/dev/null; do
      if grep -q BOOTED "$scratch/result.txt" 2>/dev/null; then break; fi
      if [ "$waited" -ge $((boot_timeout * 5)) ]; then
        touch "$scratch/boot-timeout"
        kill "$qemu_pid" 2>/dev/null
        exit 0
      fi
      sleep 0.2
      waited=$((waited + 1))
    done
    while kill -0 "$qemu_pid" 2>/dev/null; do
      if grep -q EXIT= "$scratch/result.txt" 2>/dev/null; then
        for _ in $(seq 75); do
          sleep 0.2
          kill -0 "$qemu_pid" 2>/dev/null || exit 0
        done
        kill "$qemu_pid" 2>/dev/null
        exit 0
      fi
      sleep 0.5
    done
    # (no stdout/stderr: an orphaned sleep would hold go test's pipe open)
  ) </dev/null >/dev/null 2>&1 &
  watch_pid=$!
  vm_rc=0
  # (stderr: keep bash's "Aborted" job notice out of the test output)
  { wait "$qemu_pid" || vm_rc=$?; } 2>/dev/null
  qemu_pid=
  kill "$watch_pid" 2>/dev/null || true
  wait "$watch_pid" 2>/dev/null || true
  watch_pid=
  booted=0
  if grep -q BOOTED "$scratch/result.txt"; then booted=1; fi
}

accel=tcg
case "$accel_mode" in
  kvm) accel=kvm ;;
  auto) if kvm_usable && [ "$(cat "$accel_memo" 2>/dev/null)" != tcg ]; then accel=kvm; fi ;;
esac
boot_vm "$accel"
if [ "$accel" = kvm ] && [ "$booted" = 0 ] && [ "$accel_mode" = auto ] && [ "$vm_rc" != 124 ]; then
  log "KVM did not boot the guest ($(tail -n 1 "$scratch/qemu.err")); using TCG from now on"
  echo tcg >"$accel_memo"
  accel=tcg
  boot_vm tcg
elif [ "$accel" = kvm ] && [ "$booted" = 1 ] && [ "$accel_mode" = auto ]; then
  echo kvm >"$accel_memo"
fi

exit_line=$(grep -a -o 'EXIT=[0-9]*' "$scratch/result.txt" | tail -n 1 || true)
if [ -n "$exit_line" ]; then
  exit "${exit_line#EXIT=}"
fi
if [ "$vm_rc" = 124 ]; then
  echo "$prog: timed out: the VM run took more than ${timeout_s}s (KPROXY_VM_TIMEOUT)" >&2
  exit 124
fi
if [ -e "$scratch/boot-timeout" ]; then
  echo "$prog: the VM ($accel) did not start /init within the boot timeout (KPROXY_VM_BOOT_TIMEOUT)" >&2
elif [ "$booted" = 1 ]; then
  echo "$prog: the VM stopped without reporting the test's exit code (kernel panic or crash?)" >&2
else
  echo "$prog: the VM ($accel) stopped before /init ran (qemu exit status $vm_rc)" >&2
fi
if [ -s "$scratch/qemu.err" ]; then
  sed "s/^/$prog: qemu: /" "$scratch/qemu.err" | tail -n 20 >&2
fi
exit 125
