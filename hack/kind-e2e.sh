#!/usr/bin/env bash
# kproxy end to end on a kind cluster, with real pods and real traffic.
#
# It creates a kind cluster without kube-proxy (networking.kubeProxyMode:
# none; one control-plane node and two workers), builds kproxy's image and
# loads it into the nodes, deploys hack/deploy/ (the DaemonSet pointed at
# that image and at the API server's own address, the ConfigMap at the
# proxy mode chosen with --mode: iptables, ipvs or nftables), then runs
# echo pods (agnhost netexec) behind Services and checks, from a client pod
# and from node containers (docker exec):
#   ClusterIP            requests reach every endpoint;
#   NodePort             on another node's address;
#   externalTrafficPolicy=Local
#                        the pod sees the client's own address, and a node
#                        without a local endpoint drops the traffic;
#   sessionAffinity=ClientIP
#                        every request of a client reaches the same pod;
#   no endpoints         a connection is refused at once (REJECT), not left
#                        to time out;
#   health and metrics   /healthz on :10256 and /proxyMode on :10249 (the
#                        chosen mode).
# The cluster is deleted on exit, whatever happened (--keep keeps it).
#
# Needs docker (with a running engine), kind and kubectl. It is not part of
# `make test`: run it with `make kind-e2e` or directly. --dry-run prints
# the commands without running them (no tool needed).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deploy_dir="$root/hack/deploy"

# ---- Settings (flags below override them) ----
cluster_name=${KIND_CLUSTER_NAME:-kproxy-e2e}
image=${KPROXY_IMAGE:-kproxy:kind-e2e}
node_image=${KIND_NODE_IMAGE:-}
agnhost_image=${AGNHOST_IMAGE:-registry.k8s.io/e2e-test-images/agnhost:2.66.1}
# How long a check may take to pass: kproxy programs a change within a
# sync, but pods and Services need a moment to come up first.
check_timeout=${CHECK_TIMEOUT:-90}
# kproxy's proxy mode (the ConfigMap's mode).
mode=${KPROXY_MODE:-iptables}
build=1
keep=0
dry_run=0
# The namespace of the echo workloads and the client pod.
ns=kproxy-e2e
# The image name hack/deploy/ ships with, replaced by $image.
deploy_image=kproxy:dev
# kind's pod subnet, set explicitly: it must match clusterCIDR in
# hack/deploy/02-configmap.yaml.
pod_subnet=10.244.0.0/16

usage() {
  cat <<EOF
Usage: hack/kind-e2e.sh [flags]

Creates a kind cluster without kube-proxy, deploys kproxy from hack/deploy/
and checks Services with real pods; deletes the cluster on exit.

Flags:
  --name NAME          kind cluster name (default: $cluster_name; env KIND_CLUSTER_NAME)
  --image IMAGE        kproxy image to build and load (default: $image; env KPROXY_IMAGE)
  --no-build           do not build the image: use IMAGE as it exists locally
  --node-image IMAGE   kind node image (default: kind's own; env KIND_NODE_IMAGE)
  --agnhost IMAGE      echo and client image (default: $agnhost_image; env AGNHOST_IMAGE)
  --check-timeout SEC  how long each traffic check may retry (default: $check_timeout; env CHECK_TIMEOUT)
  --mode MODE          kproxy's proxy mode: iptables, ipvs (the host kernel needs IPVS) or
                       nftables (default: $mode; env KPROXY_MODE)
  --keep               keep the cluster on exit (delete it with: kind delete cluster --name NAME)
  --dry-run            print the commands instead of running them
  -h, --help           this help
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --name) cluster_name=${2:?--name needs a value}; shift 2 ;;
    --image) image=${2:?--image needs a value}; shift 2 ;;
    --no-build) build=0; shift ;;
    --node-image) node_image=${2:?--node-image needs a value}; shift 2 ;;
    --agnhost) agnhost_image=${2:?--agnhost needs a value}; shift 2 ;;
    --check-timeout) check_timeout=${2:?--check-timeout needs a value}; shift 2 ;;
    --mode) mode=${2:?--mode needs a value}; shift 2 ;;
    --keep) keep=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "kind-e2e: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$check_timeout" in
  '' | *[!0-9]*) echo "kind-e2e: --check-timeout must be a number of seconds" >&2; exit 2 ;;
esac
case "$mode" in
  iptables | ipvs | nftables) ;;
  *) echo "kind-e2e: --mode must be iptables, ipvs or nftables" >&2; exit 2 ;;
esac

# kind names its node containers (and Nodes) after the cluster.
cp_node="$cluster_name-control-plane"
worker1="$cluster_name-worker"
worker2="$cluster_name-worker2"

# ---- Helpers ----

# The commands go to fd 3: stdout in a dry run (the command list is the
# output), stderr otherwise (a trace beside the results).
if [ "$dry_run" = 1 ]; then exec 3>&1; else exec 3>&2; fi

dry() { [ "$dry_run" = 1 ]; }

log() { printf '==> %s\n' "$*" >&2; }

fail() {
  printf 'FAIL: %s\n' "$*" >&2
  exit 1
}

# quote prints its arguments as a shell command line (words that need it
# in single quotes).
quote() {
  local out=() a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$a"); else out+=("${a@Q}"); fi
  done
  printf '%s\n' "${out[*]}"
}

# run prints a command, then runs it (not in a dry run).
run() {
  printf '+ %s\n' "$(quote "$@")" >&3
  if dry; then return 0; fi
  "$@"
}

# capture NAME CMD... runs CMD for its output. A dry run prints CMD and
# outputs the placeholder <NAME> instead. (Outside a dry run the commands
# of the checks are not traced: they repeat while a check retries.)
capture() {
  local name=$1
  shift
  if dry; then
    printf '+ %s\n' "$(quote "$@")" >&3
    printf '<%s>' "$name"
    return 0
  fi
  "$@"
}

# times N is N, or 1 in a dry run (the commands of a loop print once).
times() { if dry; then echo 1; else echo "$1"; fi; }

# eventually DESC CHECK... retries CHECK until it succeeds, for at most
# $check_timeout seconds: kproxy applies an API change within a sync, and
# a fresh pod or Service takes a moment. CHECK prints why it failed. A dry
# run prints CHECK's commands once.
eventually() {
  local desc=$1
  shift
  if dry; then
    printf '# check, retried for up to %ss: %s\n' "$check_timeout" "$desc" >&3
    "$@" >/dev/null || true
    return 0
  fi
  local deadline=$((SECONDS + check_timeout)) why
  until why=$("$@" 2>&1); do
    if [ "$SECONDS" -ge "$deadline" ]; then
      fail "$desc (after ${check_timeout}s): $why"
    fi
    sleep 2
  done
  log "ok: $desc"
}

# from SOURCE CMD... runs CMD in the client pod (SOURCE "pod") or in a node
# container (SOURCE a node name), whose network namespace is the node's.
from() {
  local src=$1
  shift
  if [ "$src" = pod ]; then
    capture reply kubectl exec -n "$ns" client -- "$@"
  else
    capture reply docker exec "$src" "$@"
  fi
}

# http SOURCE ADDR PATH sends one HTTP request and prints the body.
http() {
  from "$1" curl -sS --max-time 3 "http://$2$3"
}

# require fails unless every tool is installed (a dry run only notes it).
require() {
  local t missing=()
  for t in "$@"; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    if dry; then
      printf '# note: not installed here: %s\n' "${missing[*]}" >&3
    else
      fail "not installed: ${missing[*]}"
    fi
  fi
}

# ---- Checks: each prints why it failed and returns non-zero ----

# all_endpoints SOURCE ADDR: 20 requests reach both echo pods.
all_endpoints() {
  local src=$1 addr=$2 i reply seen=""
  for i in $(seq "$(times 20)"); do
    reply=$(http "$src" "$addr" /hostname) || { echo "request $i to $addr failed"; return 1; }
    case " $seen " in *" $reply "*) ;; *) seen="$seen $reply" ;; esac
  done
  if dry; then return 0; fi
  if [ "$(wc -w <<<"$seen")" != 2 ]; then
    echo "replies from${seen:- nobody}, want both echo pods"
    return 1
  fi
}

# same_endpoint SOURCE ADDR: 10 requests all reach one pod.
same_endpoint() {
  local src=$1 addr=$2 i reply first=""
  for i in $(seq "$(times 10)"); do
    reply=$(http "$src" "$addr" /hostname) || { echo "request $i to $addr failed"; return 1; }
    first=${first:-$reply}
    if [ "$reply" != "$first" ]; then
      echo "replies from $first and $reply: no affinity"
      return 1
    fi
  done
}

# client_ip_kept SOURCE SOURCE_IP ADDR: the pod behind ADDR sees SOURCE_IP.
client_ip_kept() {
  local src=$1 want=$2 addr=$3 reply
  reply=$(http "$src" "$addr" /clientip) || { echo "request to $addr failed"; return 1; }
  if dry; then return 0; fi
  if [ "${reply%:*}" != "$want" ]; then
    echo "the pod saw $reply, want $want (client address not kept)"
    return 1
  fi
}

# dropped SOURCE ADDR: a request times out (curl's exit code 28).
dropped() {
  local code=0
  http "$1" "$2" /hostname >/dev/null 2>&1 || code=$?
  if dry; then return 0; fi
  if [ "$code" != 28 ]; then
    echo "request to $2: curl exit code $code, want 28 (timeout)"
    return 1
  fi
}

# refused_from_pod ADDR: agnhost connect reports REFUSED.
refused_from_pod() {
  local out
  if out=$(from pod /agnhost connect --timeout=3s "$1" 2>&1); then
    if dry; then return 0; fi
    echo "connected to $1"
    return 1
  fi
  case "$out" in
    *REFUSED*) ;;
    *) echo "connect $1: $out, want REFUSED"; return 1 ;;
  esac
}

# refused_from_node NODE ADDR: curl fails with exit code 7 (refused).
refused_from_node() {
  local code=0
  http "$1" "$2" / >/dev/null 2>&1 || code=$?
  if dry; then return 0; fi
  if [ "$code" != 7 ]; then
    echo "request to $2: curl exit code $code, want 7 (refused)"
    return 1
  fi
}

# answers NODE URL WANT: a request from NODE to URL answers WANT.
answers() {
  local got
  got=$(from "$1" curl -sS --max-time 3 "$2") || { echo "request to $2 failed"; return 1; }
  if dry; then return 0; fi
  if [ "$got" != "$3" ]; then
    echo "$2 answered $got, want $3"
    return 1
  fi
}

# status NODE URL CODE: a request from NODE to URL answers HTTP CODE.
status() {
  local got
  got=$(from "$1" curl -sS --max-time 3 -o /dev/null -w '%{http_code}' "$2") || { echo "request to $2 failed"; return 1; }
  if dry; then return 0; fi
  if [ "$got" != "$3" ]; then
    echo "$2 answered HTTP $got, want $3"
    return 1
  fi
}

# Addresses of Services and Nodes.
svc_ip() { capture "$1-cluster-ip" kubectl -n "$ns" get service "$1" -o 'jsonpath={.spec.clusterIP}'; }
node_port() { capture "$1-node-port" kubectl -n "$ns" get service "$1" -o 'jsonpath={.spec.ports[0].nodePort}'; }
node_ip() { capture "$1-ip" kubectl get node "$1" -o 'jsonpath={.status.addresses[?(@.type=="InternalIP")].address}'; }

# ---- Clean-up: the cluster and the scratch directory go, however we exit ----

work=$(mktemp -d "${TMPDIR:-/tmp}/kproxy-kind-e2e.XXXXXX")
# The cluster's kubeconfig stays in the scratch directory: the user's own
# kubeconfig is never touched.
export KUBECONFIG="$work/kubeconfig"
created=0
cleanup() {
  local code=$?
  if [ "$code" != 0 ] && [ "$created" = 1 ] && ! dry; then
    log "failed; state of the cluster:"
    kubectl get pods -A -o wide >&2 || true
    kubectl -n kube-system logs -l app.kubernetes.io/name=kproxy --tail=30 --prefix >&2 || true
  fi
  if [ "$created" = 1 ]; then
    if [ "$keep" = 1 ]; then
      log "kept cluster $cluster_name (kind export kubeconfig --name $cluster_name; kind delete cluster --name $cluster_name)"
    else
      run kind delete cluster --name "$cluster_name" --kubeconfig "$KUBECONFIG" || true
    fi
  fi
  rm -rf "$work"
  exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- 0. Preflight ----
require docker kind kubectl
if ! grep -q "image: $deploy_image\$" "$deploy_dir/03-daemonset.yaml"; then
  fail "hack/deploy/03-daemonset.yaml does not use image $deploy_image: this script cannot point it at $image"
fi
# The ConfigMap's config.conf line naming the mode, replaced by $mode.
deploy_mode_line='    mode: iptables'
if ! grep -qx "$deploy_mode_line" "$deploy_dir/02-configmap.yaml"; then
  fail "hack/deploy/02-configmap.yaml has no line '$deploy_mode_line': this script cannot set the mode $mode"
fi
if ! dry && kind get clusters 2>/dev/null | grep -qx "$cluster_name"; then
  fail "a kind cluster named $cluster_name exists already (delete it, or pick another --name)"
fi

# ---- 1. The cluster: no kube-proxy, one control plane, two workers ----
log "creating kind cluster $cluster_name without kube-proxy"
cat >"$work/kind.yaml" <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  kubeProxyMode: none
  podSubnet: $pod_subnet
nodes:
  - role: control-plane
  - role: worker
  - role: worker
EOF
create=(kind create cluster --name "$cluster_name" --config "$work/kind.yaml" --kubeconfig "$KUBECONFIG")
if [ -n "$node_image" ]; then create+=(--image "$node_image"); fi
created=1
run "${create[@]}"

# ---- 2. kproxy's image, built from this tree and loaded into every node ----
if [ "$build" = 1 ]; then
  log "building $image"
  version=$(git -C "$root" describe --tags --always --dirty 2>/dev/null || echo dev)
  run docker build --build-arg "VERSION=$version" -t "$image" "$root"
fi
log "loading $image into the nodes"
run kind load docker-image "$image" --name "$cluster_name"

# ---- 3. hack/deploy/, the DaemonSet last ----
# kproxy must reach the API server without the `kubernetes` Service (no
# service proxy runs yet): the ConfigMap gets the control plane node's
# address (which the API server's certificate names) before any kproxy pod
# starts. The ConfigMap's mode is replaced with $mode, the DaemonSet's image
# with $image.
log "deploying hack/deploy/ in $mode mode"
apiserver_ip=$(node_ip "$cp_node")
for f in "$deploy_dir"/*.yaml; do
  if grep -q '^kind: DaemonSet$' "$f"; then continue; fi
  if grep -q '^kind: ConfigMap$' "$f"; then
    sed "s#^$deploy_mode_line\$#    mode: $mode#" "$f" >"$work/$(basename "$f")"
    f="$work/$(basename "$f")"
  fi
  run kubectl apply -f "$f"
done
run kubectl -n kube-system patch configmap kproxy --type merge \
  -p "{\"data\":{\"apiserver-host\":\"$apiserver_ip\",\"apiserver-port\":\"6443\"}}"
for f in "$deploy_dir"/*.yaml; do
  if ! grep -q '^kind: DaemonSet$' "$f"; then continue; fi
  sed "s#image: $deploy_image\$#image: $image#" "$f" >"$work/$(basename "$f")"
  run kubectl apply -f "$work/$(basename "$f")"
done

# ---- 4. kproxy runs everywhere; the cluster's own Services work ----
# CoreDNS reaches the API server through the `kubernetes` ClusterIP: its
# rollout finishing is a first proof that kproxy routes Services.
log "waiting for kproxy, the nodes and CoreDNS"
run kubectl -n kube-system rollout status daemonset/kproxy --timeout=180s
run kubectl wait --for=condition=Ready nodes --all --timeout=180s
run kubectl -n kube-system rollout status deployment/coredns --timeout=180s
if [ "$dry_run" = 0 ] && kubectl -n kube-system get daemonset kube-proxy >/dev/null 2>&1; then
  fail "a kube-proxy DaemonSet runs: the checks would not prove anything about kproxy"
fi

# ---- 5. Echo pods (one per worker), a client pod, and the Services ----
log "deploying the echo workloads"
cat >"$work/workloads.yaml" <<EOF
apiVersion: v1
kind: Namespace
metadata:
  name: $ns
---
# Two echo pods, one per worker (required anti-affinity): GET /hostname
# answers the pod's name, GET /clientip the address the pod saw.
apiVersion: apps/v1
kind: Deployment
metadata:
  name: echo
  namespace: $ns
spec:
  replicas: 2
  selector:
    matchLabels: {app: echo}
  template:
    metadata:
      labels: {app: echo}
    spec:
      affinity:
        podAntiAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            - labelSelector:
                matchLabels: {app: echo}
              topologyKey: kubernetes.io/hostname
      containers:
        - name: echo
          image: $agnhost_image
          args: [netexec, --http-port=8080]
          ports:
            - {name: http, containerPort: 8080}
          readinessProbe:
            httpGet: {path: /healthz, port: 8080}
---
# The client, on the first worker.
apiVersion: v1
kind: Pod
metadata:
  name: client
  namespace: $ns
spec:
  nodeName: $worker1
  containers:
    - name: client
      image: $agnhost_image
      args: [pause]
---
apiVersion: v1
kind: Service
metadata:
  name: echo
  namespace: $ns
spec:
  selector: {app: echo}
  ports:
    - {port: 80, targetPort: 8080}
---
apiVersion: v1
kind: Service
metadata:
  name: echo-nodeport
  namespace: $ns
spec:
  type: NodePort
  selector: {app: echo}
  ports:
    - {port: 80, targetPort: 8080}
---
apiVersion: v1
kind: Service
metadata:
  name: echo-local
  namespace: $ns
spec:
  type: NodePort
  externalTrafficPolicy: Local
  selector: {app: echo}
  ports:
    - {port: 80, targetPort: 8080}
---
apiVersion: v1
kind: Service
metadata:
  name: echo-affinity
  namespace: $ns
spec:
  sessionAffinity: ClientIP
  selector: {app: echo}
  ports:
    - {port: 80, targetPort: 8080}
---
# Selects no pod: no endpoints.
apiVersion: v1
kind: Service
metadata:
  name: nobody
  namespace: $ns
spec:
  selector: {app: nobody}
  ports:
    - {port: 80, targetPort: 8080}
EOF
run kubectl apply -f "$work/workloads.yaml"
run kubectl -n "$ns" rollout status deployment/echo --timeout=180s
run kubectl -n "$ns" wait --for=condition=Ready pod/client --timeout=180s

# Addresses the checks use.
echo_ip=$(svc_ip echo)
affinity_ip=$(svc_ip echo-affinity)
nobody_ip=$(svc_ip nobody)
nodeport=$(node_port echo-nodeport)
local_port=$(node_port echo-local)
cp_ip=$(node_ip "$cp_node")
worker2_ip=$(node_ip "$worker2")

# ---- 6. The checks ----
log "checking Services"
eventually "ClusterIP from a pod reaches both endpoints" all_endpoints pod "$echo_ip:80"
eventually "ClusterIP from a node reaches both endpoints" all_endpoints "$cp_node" "$echo_ip:80"
eventually "NodePort on another node, from a pod" all_endpoints pod "$worker2_ip:$nodeport"
eventually "NodePort on a worker, from the control-plane node" all_endpoints "$cp_node" "$worker2_ip:$nodeport"
eventually "NodePort on the control-plane node (no endpoint there), from a worker" all_endpoints "$worker1" "$cp_ip:$nodeport"
eventually "externalTrafficPolicy=Local keeps the client's address" client_ip_kept "$cp_node" "$cp_ip" "$worker2_ip:$local_port"
eventually "externalTrafficPolicy=Local: a node without a local endpoint drops" dropped "$worker1" "$cp_ip:$local_port"
eventually "sessionAffinity=ClientIP sticks to one pod" same_endpoint pod "$affinity_ip:80"
eventually "no endpoints: refused at once, from a pod" refused_from_pod "$nobody_ip:80"
eventually "no endpoints: refused at once, from a node" refused_from_node "$worker2" "$nobody_ip:80"
for node in "$cp_node" "$worker1" "$worker2"; do
  eventually "kproxy's /healthz on $node" status "$node" http://127.0.0.1:10256/healthz 200
  eventually "kproxy's /proxyMode on $node" answers "$node" http://127.0.0.1:10249/proxyMode "$mode"
done

if dry; then
  log "dry run: nothing was run"
else
  log "PASS: kproxy ($mode mode) serves ClusterIP, NodePort, externalTrafficPolicy=Local, session affinity and no-endpoint rejects on kind"
fi
