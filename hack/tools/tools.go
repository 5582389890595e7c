//go:build tools

// Package tools pins modules the agent uses so `go mod tidy` keeps them
// while packages are still being wired.
package tools

import (
	_ "github.com/coreos/go-iptables/iptables"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/spf13/cobra"
	_ "github.com/vishvananda/netlink"
	_ "github.com/vishvananda/netns"
	_ "golang.org/x/sys/unix"
	_ "k8s.io/client-go/informers"
	_ "k8s.io/client-go/kubernetes/fake"
	_ "k8s.io/klog/v2"
	_ "k8s.io/utils/clock/testing"
)
