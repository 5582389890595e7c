package procbench

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
)

// Environment variables of TestProcessBenchmark.
const (
	EnvEnable   = "KPROXY_PROCBENCH"
	EnvServices = "KPROXY_PROCBENCH_SERVICES"
	EnvNodes    = "KPROXY_PROCBENCH_NODES"
	EnvModes    = "KPROXY_PROCBENCH_MODES"
	EnvChanges  = "KPROXY_PROCBENCH_CHANGES"
	EnvOut      = "KPROXY_PROCBENCH_OUT"
	EnvKproxy   = "KPROXY_PROCBENCH_KPROXY"
	EnvState    = "KPROXY_PROCBENCH_STATE"
	// EnvProfileDir: where to save kproxy's heap profiles (unset: none).
	EnvProfileDir = "KPROXY_PROCBENCH_PROFILE_DIR"
	// EnvFloor: "0" leaves out the floor program's runs (floor.go).
	EnvFloor = "KPROXY_PROCBENCH_FLOOR"
)

// Config is what the environment asks of the benchmark.
type Config struct {
	// Services are the sizes, ascending (default 1000 10000).
	Services []int
	// Nodes is how many Node objects the largest size runs with once more
	// (default 5000; 1 or less: no such run).
	Nodes int
	// Modes are the proxy modes (default iptables nftables).
	Modes []string
	// Changes per run (default DefaultChanges).
	Changes int
	// Out is the JSON report's path (empty: none).
	Out string
	// Kproxy is the kproxy program to use (empty: build one); several,
	// separated by spaces, each run in turn against the same objects.
	Kproxy string
	// StateDir is the control plane's state directory.
	StateDir string
	// ProfileDir, when set, receives kproxy's heap profiles after its
	// first sync and after the changes of each run.
	ProfileDir string
	// Floor runs the floor program (floor.go) after kproxy at each size
	// with the measured node alone, when nftables is among the modes.
	Floor bool
}

// Step is a set of objects the modes run against.
type Step struct {
	Services, Nodes int
}

// Steps are the object sets in the order they are reached (objects are
// only ever added): each size with the measured node alone, then the
// largest with Nodes nodes.
func (c Config) Steps() []Step {
	var out []Step
	for _, n := range c.Services {
		out = append(out, Step{Services: n, Nodes: 1})
	}
	if c.Nodes > 1 && len(c.Services) > 0 {
		out = append(out, Step{Services: c.Services[len(c.Services)-1], Nodes: c.Nodes})
	}
	return out
}

// ParseConfig reads the configuration through getenv (os.Getenv).
func ParseConfig(getenv func(string) string) (Config, error) {
	c := Config{
		Nodes: 5000, Modes: []string{"iptables", "nftables"}, Changes: DefaultChanges,
		Out: getenv(EnvOut), Kproxy: getenv(EnvKproxy), StateDir: getenv(EnvState),
		ProfileDir: getenv(EnvProfileDir), Floor: strings.TrimSpace(getenv(EnvFloor)) != "0",
	}
	if c.StateDir == "" {
		c.StateDir = "/run/kpc-procbench"
	}
	var errs []error
	sizes := getenv(EnvServices)
	if strings.TrimSpace(sizes) == "" {
		sizes = "1000 10000"
	}
	for _, f := range strings.Fields(sizes) {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 || n > MaxServices {
			errs = append(errs, fmt.Errorf("%s: %q is not a number of Services within 1..%d", EnvServices, f, MaxServices))
			continue
		}
		c.Services = append(c.Services, n)
	}
	slices.Sort(c.Services)
	c.Services = slices.Compact(c.Services)
	if v := strings.TrimSpace(getenv(EnvNodes)); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > EndpointNodes {
			errs = append(errs, fmt.Errorf("%s: %q is not a number of Nodes within 0..%d", EnvNodes, v, EndpointNodes))
		}
		c.Nodes = n
	}
	if v := strings.Fields(getenv(EnvModes)); len(v) > 0 {
		c.Modes = slices.Compact(v)
	}
	c.Floor = c.Floor && slices.Contains(c.Modes, "nftables")
	if v := strings.TrimSpace(getenv(EnvChanges)); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			errs = append(errs, fmt.Errorf("%s: %q is not a positive number", EnvChanges, v))
		}
		c.Changes = n
	}
	return c, errors.Join(errs...)
}

// ipvsSupport says whether this kernel has IPVS, and if not why.
func ipvsSupport() (bool, string) {
	if _, err := os.Stat("/proc/net/ip_vs"); err == nil {
		return true, ""
	}
	return false, "this kernel has no IPVS (no /proc/net/ip_vs; IPVS mode is measured in a VM by the proxier/ipvs benchmarks)"
}
