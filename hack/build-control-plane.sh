#!/usr/bin/env bash
# Builds the local cluster's programs (see test/LOCAL-CLUSTER.md) into
# test/_cache/bin/<hash>/, <hash> being the first 12 hex digits of the sha256
# of test/go.sum and of the list of slow programs below with their packages:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
#   (k8s.io/kubernetes, kubectl from k8s.io/kubectl at the same version) and
#   etcd (test/cmd/etcd): built only when missing, since they take minutes
#   and depend on nothing but test/go.sum and that list;
#   kpc (test/cmd/kpc) and kproxy (cmd/kproxy): rebuilt every time (seconds).
# Prints the bin directory as the last line of its output.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH="/usr/local/go/bin:$PATH"
GO=${GO:-go}
test_dir="$root/test"
cache="$test_dir/_cache/bin"

log() { echo "build-control-plane: $*" >&2; }

# kubectl is here so that every command the demo prints runs on a machine
# without one (`kpc kubectl ...`).
slow=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd)
declare -A pkg=(
  [kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
  [kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager
  [kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
  [kubectl]=k8s.io/kubernetes/cmd/kubectl
  [etcd]=./cmd/etcd
)

# A new go.sum or a new set of slow programs is a new directory.
hash=$({
  cat "$test_dir/go.sum"
  for b in "${slow[@]}"; do echo "$b=${pkg[$b]}"; done
} | sha256sum | cut -c1-12)
bin="$cache/$hash"
mkdir -p "$bin"

# A one-off build into _cache/bin/probe (same go.sum) is adopted rather than
# rebuilt, unless a go build is still writing it.
probe="$cache/probe"
if [ -d "$probe" ] && ! pgrep -f -- "-o _cache/bin/probe" >/dev/null 2>&1; then
  for b in "${slow[@]}"; do
    if [ ! -x "$bin/$b" ] && [ -x "$probe/$b" ]; then
      log "adopting $b from $probe"
      mv "$probe/$b" "$bin/$b"
    fi
  done
  rmdir "$probe" 2>/dev/null || true
fi

missing=()
for b in "${slow[@]}"; do
  [ -x "$bin/$b" ] || missing+=("$b")
done

if [ ${#missing[@]} -gt 0 ]; then
  log "building ${missing[*]} (several minutes on a cold cache)"
  tmp=$(mktemp -d "$cache/.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  pkgs=()
  for b in "${missing[@]}"; do pkgs+=("${pkg[$b]}"); done
  # Stamp the Kubernetes version (kubectl version, /version), as upstream's
  # build does.
  kver=$(cd "$test_dir" && "$GO" list -m -f '{{.Version}}' k8s.io/kubernetes)
  kmajor=${kver#v}; kmajor=${kmajor%%.*}
  kminor=${kver#v*.}; kminor=${kminor%%.*}
  ldflags=""
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=$kver -X $p.gitMajor=$kmajor -X $p.gitMinor=$kminor -X $p.gitTreeState=clean"
  done
  start=$SECONDS
  (cd "$test_dir" && "$GO" build -trimpath -ldflags "$ldflags" -o "$tmp/" "${pkgs[@]}")
  # Each binary appears in bin only once complete.
  for b in "${missing[@]}"; do mv "$tmp/$b" "$bin/$b"; done
  log "built ${missing[*]} in $((SECONDS - start))s"
fi

version=$(git -C "$root" describe --tags --always --dirty 2>/dev/null || echo dev)
(cd "$test_dir" && "$GO" build -trimpath -o "$bin/kpc.new" ./cmd/kpc) && mv "$bin/kpc.new" "$bin/kpc"
(cd "$root" && "$GO" build -trimpath \
  -ldflags "-X github.com/kproxy/kproxy/cmd/kproxy/app.Version=$version" \
  -o "$bin/kproxy.new" ./cmd/kproxy) && mv "$bin/kproxy.new" "$bin/kproxy"

# Binaries for an older go.sum or program list are never used again.
for d in "$cache"/*/; do
  d=${d%/}
  case "$(basename "$d")" in "$hash" | probe) continue ;; esac
  log "removing stale $d"
  rm -rf "$d"
done

echo "$bin"
