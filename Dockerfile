# kproxy image: a static Go binary on Debian slim with iptables (legacy and
# nft), nftables (nft, for nftables mode), ipset and conntrack. The entrypoint picks the iptables flavour the
# host already uses, so kproxy's rules land beside the host's.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath \
      -ldflags "-s -w -X github.com/kproxy/kproxy/cmd/kproxy/app.Version=${VERSION}" \
      -o /out/kproxy ./cmd/kproxy

FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      iptables nftables ipset conntrack iproute2 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/kproxy /usr/local/bin/kproxy
COPY hack/iptables-mode.sh /usr/local/bin/kproxy-entrypoint
ENTRYPOINT ["/usr/local/bin/kproxy-entrypoint"]
