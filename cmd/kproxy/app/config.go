package app

// The config file: kube-proxy's KubeProxyConfiguration
// (kubeproxy.config.k8s.io/v1alpha1) read by --config, so that an existing
// kube-proxy ConfigMap works as it is, and written by --write-config-to.
//
// Precedence: kproxy's defaults, then the file, then every flag given on
// the command line. As in kube-proxy, a zero value in the file (0s, "",
// null) means "the default": kubeadm writes every field, most of them zero.

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/klog/v2"
	kubeproxyconfig "k8s.io/kube-proxy/config/v1alpha1"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// Ports kube-proxy appends to a bind address given without one.
const (
	defaultHealthzPort = 10256
	defaultMetricsPort = 10249
)

// kube-proxy's defaults for settings kproxy does not support: a file
// holding them (as `kube-proxy --write-config-to` writes) loads without
// warnings.
const (
	kubeProxyDefaultQPS         = 5
	kubeProxyDefaultBurst       = 10
	kubeProxyDefaultContentType = "application/vnd.kubernetes.protobuf"
	kubeProxyDefaultOOMScoreAdj = -999
	kubeProxyDefaultMasqBit     = 14
	kubeProxyDefaultFlush       = 5 * time.Second
	kubeProxyDefaultSyncPeriod  = 30 * time.Second
	kubeProxyDefaultMinSync     = time.Second
)

// kube-proxy's mode that kproxy does not have.
const kubeProxyModeKernelspace = "kernelspace"

// ConfigWarning is a setting of a config file that kproxy does not honour,
// or reads differently from kube-proxy.
type ConfigWarning struct {
	// Field is the setting's path in the file ("iptables.localhostNodePorts"),
	// or a flag ("--service-proxy-name") that a file cannot express.
	Field string
	// Message says what kproxy does instead.
	Message string
}

func (w ConfigWarning) String() string { return w.Field + ": " + w.Message }

// newConfigCodecs returns strict codecs that know KubeProxyConfiguration
// v1alpha1 only.
func newConfigCodecs() (serializer.CodecFactory, error) {
	scheme := runtime.NewScheme()
	if err := kubeproxyconfig.AddToScheme(scheme); err != nil {
		return serializer.CodecFactory{}, fmt.Errorf("registering KubeProxyConfiguration: %w", err)
	}
	return serializer.NewCodecFactory(scheme, serializer.EnableStrict), nil
}

// DecodeProxyConfig decodes a KubeProxyConfiguration (YAML or JSON).
// Unknown and duplicate fields are warnings, as kube-proxy treats them
// (it falls back to lenient decoding); anything else (not YAML, another
// kind or version) is an error.
func DecodeProxyConfig(data []byte) (*kubeproxyconfig.KubeProxyConfiguration, []ConfigWarning, error) {
	codecs, err := newConfigCodecs()
	if err != nil {
		return nil, nil, err
	}
	obj, gvk, err := codecs.UniversalDeserializer().Decode(data, nil, nil)
	var warnings []ConfigWarning
	if err != nil {
		if !runtime.IsStrictDecodingError(err) {
			return nil, nil, fmt.Errorf("decoding a %s KubeProxyConfiguration: %w", kubeproxyconfig.SchemeGroupVersion, err)
		}
		// The object is complete: strict errors only name what was
		// dropped (unknown fields) or overwritten (duplicates).
		if strictErr, ok := runtime.AsStrictDecodingError(err); ok {
			for _, e := range strictErr.Errors() {
				warnings = append(warnings, strictWarnings(e)...)
			}
		}
	}
	cfg, ok := obj.(*kubeproxyconfig.KubeProxyConfiguration)
	if !ok {
		return nil, nil, fmt.Errorf("decoding a KubeProxyConfiguration: got %v", gvk)
	}
	return cfg, warnings, nil
}

// yamlDuplicate matches a duplicate key in a YAML parser's error.
var yamlDuplicate = regexp.MustCompile(`line (\d+): key "([^"]+)" already set in map`)

// strictWarnings turns a strict decoding error into warnings naming the
// fields when the error knows them.
func strictWarnings(err error) []ConfigWarning {
	msg := err.Error()
	var withPath interface{ FieldPath() string }
	if errors.As(err, &withPath) {
		switch {
		case strings.HasPrefix(msg, "unknown field"):
			return []ConfigWarning{{Field: withPath.FieldPath(), Message: "ignored: unknown field (misspelt, or from another kube-proxy version)"}}
		case strings.HasPrefix(msg, "duplicate field"):
			return []ConfigWarning{{Field: withPath.FieldPath(), Message: "set more than once: the last value wins"}}
		default:
			return []ConfigWarning{{Field: withPath.FieldPath(), Message: msg}}
		}
	}
	// The YAML parser reports duplicate keys by line, without their path.
	if dups := yamlDuplicate.FindAllStringSubmatch(msg, -1); len(dups) > 0 {
		out := make([]ConfigWarning, len(dups))
		for i, d := range dups {
			out[i] = ConfigWarning{Field: d[2], Message: "set more than once (again on line " + d[1] + "): the last value wins"}
		}
		return out
	}
	return []ConfigWarning{{Field: "(file)", Message: msg}}
}

// LoadProxyConfig reads and decodes the KubeProxyConfiguration at path.
func LoadProxyConfig(path string) (*kubeproxyconfig.KubeProxyConfiguration, []ConfigWarning, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("reading the config file: %w", err)
	}
	cfg, warnings, err := DecodeProxyConfig(data)
	if err != nil {
		return nil, nil, fmt.Errorf("config file %s: %w", path, err)
	}
	return cfg, warnings, nil
}

// configApplier applies a file's settings to Options, skipping those whose
// flag was given on the command line, and gathers warnings and errors.
type configApplier struct {
	o        *Options
	fs       *pflag.FlagSet
	warnings []ConfigWarning
	errs     []error
}

// fromFile reports whether the file may set the option of flag: not when
// the flag was given on the command line.
func (a *configApplier) fromFile(flag string) bool {
	if a.fs == nil {
		return true
	}
	f := a.fs.Lookup(flag)
	return f == nil || !f.Changed
}

func (a *configApplier) warn(field, format string, args ...any) {
	a.warnings = append(a.warnings, ConfigWarning{Field: field, Message: fmt.Sprintf(format, args...)})
}

func (a *configApplier) fail(field, format string, args ...any) {
	a.errs = append(a.errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
}

// ignored warns that a field set to a value other than zero or
// kube-proxy's default is not supported.
func (a *configApplier) ignored(field string, set bool, why string) {
	if set {
		a.warn(field, "ignored: not supported by kproxy%s", why)
	}
}

// duration sets *dst from a file duration, unless it is zero (the default)
// or flag was given.
func (a *configApplier) duration(d metav1.Duration, flag string, dst *time.Duration) {
	if d.Duration != 0 && a.fromFile(flag) {
		*dst = d.Duration
	}
}

// ApplyProxyConfig sets every option cfg sets, except those whose flag
// fs reports as given on the command line (fs may be nil: the file sets
// everything). It returns warnings for settings kproxy does not honour and
// an error for settings it cannot run with (say mode "kernelspace").
// logging.verbosity and logging.vmodule set klog's -v and --vmodule
// flags, when fs has them.
func (o *Options) ApplyProxyConfig(cfg *kubeproxyconfig.KubeProxyConfiguration, fs *pflag.FlagSet) ([]ConfigWarning, error) {
	a := &configApplier{o: o, fs: fs}
	a.general(cfg)
	// The mode first: it picks the block (iptables or nftables) that sets
	// the shared masquerade and sync settings.
	a.mode(cfg)
	a.iptables(cfg)
	a.ipvs(cfg)
	a.nftables(cfg)
	a.conntrack(cfg)
	a.network(cfg)
	a.logging(cfg)
	a.windows(cfg)
	return a.warnings, errors.Join(a.errs...)
}

func (a *configApplier) general(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	o := a.o
	cc := cfg.ClientConnection
	if cc.Kubeconfig != "" && a.fromFile("kubeconfig") {
		o.Kubeconfig = cc.Kubeconfig
	}
	a.ignored("clientConnection.qps", cc.QPS != 0 && cc.QPS != kubeProxyDefaultQPS, "; client-go's rate limit (5 qps) applies")
	a.ignored("clientConnection.burst", cc.Burst != 0 && cc.Burst != kubeProxyDefaultBurst, "; client-go's burst (10) applies")
	if cc.ContentType != "" && a.fromFile("kube-api-content-type") {
		o.KubeAPIContentType = cc.ContentType
	}
	a.ignored("clientConnection.acceptContentTypes", cc.AcceptContentTypes != "", "")

	if cfg.HostnameOverride != "" && a.fromFile("hostname-override") {
		o.HostnameOverride = cfg.HostnameOverride
	}
	if cfg.HealthzBindAddress != "" && a.fromFile("healthz-bind-address") {
		o.HealthzBindAddress = appendPortIfNeeded(cfg.HealthzBindAddress, defaultHealthzPort)
	}
	if cfg.MetricsBindAddress != "" && a.fromFile("metrics-bind-address") {
		o.MetricsBindAddress = appendPortIfNeeded(cfg.MetricsBindAddress, defaultMetricsPort)
	}
	a.duration(cfg.ConfigSyncPeriod, "config-sync-period", &o.ConfigSyncPeriod)

	if cfg.BindAddress != "" && a.fromFile("bind-address") {
		o.BindAddress = cfg.BindAddress
	}
	a.ignored("bindAddressHardFail", cfg.BindAddressHardFail, "; a server that cannot bind is logged and retried while rules keep being programmed")
	if a.fromFile("profiling") {
		o.Profiling = cfg.EnableProfiling
	}
	a.ignored("showHiddenMetricsForVersion", cfg.ShowHiddenMetricsForVersion != "", "")
	a.ignored("oomScoreAdj", cfg.OOMScoreAdj != nil && *cfg.OOMScoreAdj != kubeProxyDefaultOOMScoreAdj, "; give the DaemonSet a priority class instead")
	a.ignored("portRange", cfg.PortRange != "", " (nor by kube-proxy: it belonged to the removed userspace mode)")
	gates := make([]string, 0, len(cfg.FeatureGates))
	for g := range cfg.FeatureGates {
		gates = append(gates, g)
	}
	slices.Sort(gates)
	for _, g := range gates {
		a.warn("featureGates."+g, "ignored: kproxy has no feature gates")
	}
}

func (a *configApplier) mode(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	switch string(cfg.Mode) {
	case "":
		return
	case ModeIPTables, ModeIPVS, ModeNFTables:
		if a.fromFile("proxy-mode") {
			a.o.ProxyMode = string(cfg.Mode)
		}
	case kubeProxyModeKernelspace:
		a.fail("mode", "%q is kube-proxy's Windows mode; kproxy runs on Linux: use %s", cfg.Mode, modeList)
	default:
		a.fail("mode", "%q is not a proxy mode; use %s", cfg.Mode, modeList)
	}
}

// nftablesMode reports whether the options, as applied so far, run
// nftables mode: the nftables block then sets the masquerade and sync
// settings, as in kube-proxy, and the iptables block is not read.
func (a *configApplier) nftablesMode() bool { return a.o.ProxyMode == ModeNFTables }

// masqueradeAndSync maps a block's masqueradeBit, masqueradeAll,
// syncPeriod and minSyncPeriod (the iptables and nftables blocks share
// them) onto the options, under the same flags.
func (a *configApplier) masqueradeAndSync(bit *int32, all bool, sync, minSync metav1.Duration) {
	o := a.o
	if bit != nil && a.fromFile("iptables-masquerade-bit") {
		o.MasqueradeBit = int(*bit)
	}
	if all && a.fromFile("masquerade-all") {
		o.MasqueradeAll = true
	}
	a.duration(sync, "iptables-sync-period", &o.SyncPeriod)
	a.duration(minSync, "iptables-min-sync-period", &o.MinSyncPeriod)
}

// blockSet reports whether a block's shared settings differ from zero and
// kube-proxy's defaults.
func blockSet(bit *int32, all bool, sync, minSync metav1.Duration) bool {
	return all ||
		(bit != nil && *bit != kubeProxyDefaultMasqBit) ||
		(sync.Duration != 0 && sync.Duration != kubeProxyDefaultSyncPeriod) ||
		(minSync.Duration != 0 && minSync.Duration != kubeProxyDefaultMinSync)
}

// iptables maps the iptables block, which iptables and IPVS modes read.
func (a *configApplier) iptables(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	ipt := cfg.IPTables
	if a.nftablesMode() {
		a.ignored("iptables", blockSet(ipt.MasqueradeBit, ipt.MasqueradeAll, ipt.SyncPeriod, ipt.MinSyncPeriod),
			" in nftables mode, which reads the nftables block (as kube-proxy does)")
		return
	}
	a.masqueradeAndSync(ipt.MasqueradeBit, ipt.MasqueradeAll, ipt.SyncPeriod, ipt.MinSyncPeriod)
	if ipt.LocalhostNodePorts != nil && *ipt.LocalhostNodePorts {
		a.warn("iptables.localhostNodePorts", "ignored: kproxy never serves NodePorts on 127.0.0.1 (it would need route_localnet)")
	}
}

// nftables maps the nftables block, which only nftables mode reads.
func (a *configApplier) nftables(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	nft := cfg.NFTables
	if !a.nftablesMode() {
		a.ignored("nftables", blockSet(nft.MasqueradeBit, nft.MasqueradeAll, nft.SyncPeriod, nft.MinSyncPeriod),
			" outside nftables mode (kube-proxy too reads it only in nftables mode)")
		return
	}
	a.masqueradeAndSync(nft.MasqueradeBit, nft.MasqueradeAll, nft.SyncPeriod, nft.MinSyncPeriod)
}

func (a *configApplier) network(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	o := a.o
	if cfg.ClusterCIDR != "" && a.fromFile("cluster-cidr") {
		o.ClusterCIDR = cfg.ClusterCIDR
	}
	switch cfg.DetectLocalMode {
	case "", "ClusterCIDR":
	default:
		a.warn("detectLocalMode", "%q ignored: kproxy tells pod traffic from other traffic by clusterCIDR only", cfg.DetectLocalMode)
	}
	a.ignored("detectLocal", cfg.DetectLocal != (kubeproxyconfig.DetectLocalConfiguration{}), "; kproxy uses clusterCIDR")
	if len(cfg.NodePortAddresses) > 0 && a.fromFile("nodeport-addresses") {
		o.NodePortAddresses = slices.Clone(cfg.NodePortAddresses)
		for _, s := range cfg.NodePortAddresses {
			if strings.TrimSpace(s) == proxy.NodePortAddressesLocalhost {
				a.warn("nodePortAddresses", "%q: kproxy never serves NodePorts on loopback addresses", s)
			}
		}
	}
}

func (a *configApplier) logging(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	l := cfg.Logging
	if l.Verbosity != 0 && a.fs != nil && a.fs.Lookup("v") != nil && a.fromFile("v") {
		if err := a.fs.Set("v", strconv.FormatUint(uint64(l.Verbosity), 10)); err != nil {
			a.fail("logging.verbosity", "%v", err)
		}
	}
	if len(l.VModule) > 0 && a.fs != nil && a.fs.Lookup("vmodule") != nil && a.fromFile("vmodule") {
		items := make([]string, len(l.VModule))
		for i, m := range l.VModule {
			items[i] = fmt.Sprintf("%s=%d", m.FilePattern, m.Verbosity)
		}
		if err := a.fs.Set("vmodule", strings.Join(items, ",")); err != nil {
			a.fail("logging.vmodule", "%v", err)
		}
	}
	a.ignored("logging.format", l.Format != "" && l.Format != "text", "; kproxy logs text (klog)")
	flush := l.FlushFrequency.Duration.Duration
	a.ignored("logging.flushFrequency", flush != 0 && flush != kubeProxyDefaultFlush, "")
}

func (a *configApplier) windows(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	a.ignored("winkernel", cfg.Winkernel != (kubeproxyconfig.KubeProxyWinkernelConfiguration{}), " (Windows only)")
	a.ignored("windowsRunAsService", cfg.WindowsRunAsService, " (Windows only)")
}

// appendPortIfNeeded adds port to a bare IP address, as kube-proxy reads
// healthzBindAddress and metricsBindAddress; anything else is returned as
// it is, for Validate to judge.
func appendPortIfNeeded(addr string, port int) string {
	if _, _, err := net.SplitHostPort(addr); err == nil {
		return addr
	}
	ip, err := netip.ParseAddr(strings.Trim(addr, "[]"))
	if err != nil {
		return addr
	}
	return net.JoinHostPort(ip.String(), strconv.Itoa(port))
}

// ProxyConfig returns the options as a KubeProxyConfiguration, for
// --write-config-to, and warnings for the options a file cannot express.
// fs, when it has klog's -v, gives logging.verbosity.
func (o *Options) ProxyConfig(fs *pflag.FlagSet) (*kubeproxyconfig.KubeProxyConfiguration, []ConfigWarning) {
	var warnings []ConfigWarning
	bit := int32(o.MasqueradeBit)
	cfg := &kubeproxyconfig.KubeProxyConfiguration{
		TypeMeta:           metav1.TypeMeta{APIVersion: kubeproxyconfig.SchemeGroupVersion.String(), Kind: "KubeProxyConfiguration"},
		HostnameOverride:   o.HostnameOverride,
		BindAddress:        o.BindAddress,
		HealthzBindAddress: o.HealthzBindAddress,
		MetricsBindAddress: o.MetricsBindAddress,
		Mode:               kubeproxyconfig.ProxyMode(o.ProxyMode),
		ClusterCIDR:        o.ClusterCIDR,
		NodePortAddresses:  slices.Clone(o.NodePortAddresses),
		ConfigSyncPeriod:   metav1.Duration{Duration: o.ConfigSyncPeriod},
	}
	// The masquerade and sync settings go to the block the mode reads.
	minSyncField := "iptables.minSyncPeriod"
	if o.ProxyMode == ModeNFTables {
		minSyncField = "nftables.minSyncPeriod"
		cfg.NFTables = kubeproxyconfig.KubeProxyNFTablesConfiguration{
			MasqueradeBit: &bit,
			MasqueradeAll: o.MasqueradeAll,
			SyncPeriod:    metav1.Duration{Duration: o.SyncPeriod},
			MinSyncPeriod: metav1.Duration{Duration: o.MinSyncPeriod},
		}
	} else {
		cfg.IPTables = kubeproxyconfig.KubeProxyIPTablesConfiguration{
			MasqueradeBit: &bit,
			MasqueradeAll: o.MasqueradeAll,
			SyncPeriod:    metav1.Duration{Duration: o.SyncPeriod},
			MinSyncPeriod: metav1.Duration{Duration: o.MinSyncPeriod},
		}
	}
	cfg.ClientConnection.Kubeconfig = o.Kubeconfig
	cfg.ClientConnection.ContentType = o.KubeAPIContentType
	cfg.EnableProfiling = o.Profiling
	o.ipvsProxyConfig(cfg)
	o.conntrackProxyConfig(cfg)
	if fs != nil {
		if f := fs.Lookup("v"); f != nil {
			if v, err := strconv.ParseUint(f.Value.String(), 10, 32); err == nil {
				cfg.Logging.Verbosity = logsapi.VerbosityLevel(v)
			}
		}
	}
	if o.HealthzBindAddress == "" {
		warnings = append(warnings, ConfigWarning{Field: "healthzBindAddress",
			Message: "the health server is disabled, which a config file cannot express (empty means the default): pass --healthz-bind-address= alongside --config"})
	}
	if o.MetricsBindAddress == "" {
		warnings = append(warnings, ConfigWarning{Field: "metricsBindAddress",
			Message: "the metrics server is disabled, which a config file cannot express (empty means the default): pass --metrics-bind-address= alongside --config"})
	}
	if o.MinSyncPeriod == 0 {
		warnings = append(warnings, ConfigWarning{Field: minSyncField,
			Message: "0 (sync at once) reads back as the default (1s) from a config file: pass --iptables-min-sync-period=0 alongside --config"})
	}
	for _, f := range []struct {
		flag string
		set  bool
	}{
		{"--master", o.Master != ""},
		{"--service-proxy-name", o.ServiceProxyName != ""},
		{"--iptables-restore-batch-chains", o.IPTablesBatchChain != NewOptions().IPTablesBatchChain},
	} {
		if f.set {
			warnings = append(warnings, ConfigWarning{Field: f.flag, Message: "has no KubeProxyConfiguration field: pass the flag alongside --config"})
		}
	}
	return cfg, warnings
}

// WriteProxyConfig writes cfg as KubeProxyConfiguration YAML to path.
func WriteProxyConfig(path string, cfg *kubeproxyconfig.KubeProxyConfiguration) error {
	data, err := EncodeProxyConfig(cfg)
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		return fmt.Errorf("writing the configuration: %w", err)
	}
	return nil
}

// EncodeProxyConfig returns cfg as KubeProxyConfiguration YAML.
func EncodeProxyConfig(cfg *kubeproxyconfig.KubeProxyConfiguration) ([]byte, error) {
	codecs, err := newConfigCodecs()
	if err != nil {
		return nil, err
	}
	info, ok := runtime.SerializerInfoForMediaType(codecs.SupportedMediaTypes(), runtime.ContentTypeYAML)
	if !ok {
		return nil, errors.New("no YAML serializer")
	}
	data, err := runtime.Encode(codecs.EncoderForVersion(info.Serializer, kubeproxyconfig.SchemeGroupVersion), cfg)
	if err != nil {
		return nil, fmt.Errorf("encoding the configuration: %w", err)
	}
	return data, nil
}

// ---- IPVS and conntrack settings (their flags: ipvsmode.go, conntrack.go) ----

func (a *configApplier) ipvs(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	o, ipvs := a.o, cfg.IPVS
	if ipvs.Scheduler != "" && a.fromFile("ipvs-scheduler") {
		o.IPVSScheduler = ipvs.Scheduler
	}
	if ipvs.StrictARP && a.fromFile("ipvs-strict-arp") {
		o.IPVSStrictARP = true
	}
	a.duration(ipvs.TCPTimeout, "ipvs-tcp-timeout", &o.IPVSTCPTimeout)
	a.duration(ipvs.TCPFinTimeout, "ipvs-tcpfin-timeout", &o.IPVSTCPFinTimeout)
	a.duration(ipvs.UDPTimeout, "ipvs-udp-timeout", &o.IPVSUDPTimeout)
	if len(ipvs.ExcludeCIDRs) > 0 && a.fromFile("ipvs-exclude-cidrs") {
		o.IPVSExcludeCIDRs = slices.Clone(ipvs.ExcludeCIDRs)
	}
	a.duration(ipvs.SyncPeriod, "ipvs-sync-period", &o.IPVSSyncPeriod)
	a.duration(ipvs.MinSyncPeriod, "ipvs-min-sync-period", &o.IPVSMinSyncPeriod)
}

// conntrack maps conntrack.*: a null pointer is the default, while an
// explicit 0 leaves the kernel's value (as in kube-proxy).
func (a *configApplier) conntrack(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	o, ct := a.o, cfg.Conntrack
	if ct.MaxPerCore != nil && a.fromFile("conntrack-max-per-core") {
		o.Conntrack.MaxPerCore = int(*ct.MaxPerCore)
	}
	if ct.Min != nil && a.fromFile("conntrack-min") {
		o.Conntrack.Min = int(*ct.Min)
	}
	if ct.TCPEstablishedTimeout != nil && a.fromFile("conntrack-tcp-timeout-established") {
		o.Conntrack.TCPEstablishedTimeout = ct.TCPEstablishedTimeout.Duration
	}
	if ct.TCPCloseWaitTimeout != nil && a.fromFile("conntrack-tcp-timeout-close-wait") {
		o.Conntrack.TCPCloseWaitTimeout = ct.TCPCloseWaitTimeout.Duration
	}
	if ct.TCPBeLiberal && a.fromFile("conntrack-tcp-be-liberal") {
		o.Conntrack.TCPBeLiberal = true
	}
	a.duration(ct.UDPTimeout, "conntrack-udp-timeout", &o.Conntrack.UDPTimeout)
	a.duration(ct.UDPStreamTimeout, "conntrack-udp-timeout-stream", &o.Conntrack.UDPStreamTimeout)
}

func (o *Options) ipvsProxyConfig(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	cfg.IPVS = kubeproxyconfig.KubeProxyIPVSConfiguration{
		Scheduler:     o.IPVSScheduler,
		StrictARP:     o.IPVSStrictARP,
		TCPTimeout:    metav1.Duration{Duration: o.IPVSTCPTimeout},
		TCPFinTimeout: metav1.Duration{Duration: o.IPVSTCPFinTimeout},
		UDPTimeout:    metav1.Duration{Duration: o.IPVSUDPTimeout},
		ExcludeCIDRs:  slices.Clone(o.IPVSExcludeCIDRs),
		SyncPeriod:    metav1.Duration{Duration: o.IPVSSyncPeriod},
		MinSyncPeriod: metav1.Duration{Duration: o.IPVSMinSyncPeriod},
	}
}

func (o *Options) conntrackProxyConfig(cfg *kubeproxyconfig.KubeProxyConfiguration) {
	c := o.Conntrack
	maxPerCore, minimum := int32(c.MaxPerCore), int32(c.Min)
	cfg.Conntrack = kubeproxyconfig.KubeProxyConntrackConfiguration{
		MaxPerCore:            &maxPerCore,
		Min:                   &minimum,
		TCPEstablishedTimeout: &metav1.Duration{Duration: c.TCPEstablishedTimeout},
		TCPCloseWaitTimeout:   &metav1.Duration{Duration: c.TCPCloseWaitTimeout},
		TCPBeLiberal:          c.TCPBeLiberal,
		UDPTimeout:            metav1.Duration{Duration: c.UDPTimeout},
		UDPStreamTimeout:      metav1.Duration{Duration: c.UDPStreamTimeout},
	}
}

// ---- Command wiring ----

// applyConfigFile reads --config, when set, under the flags given on the
// command line, and logs the file's warnings.
func (o *Options) applyConfigFile(fs *pflag.FlagSet, logger klog.Logger) error {
	if o.ConfigFile == "" {
		return nil
	}
	cfg, warnings, err := LoadProxyConfig(o.ConfigFile)
	if err != nil {
		return err
	}
	applyWarnings, err := o.ApplyProxyConfig(cfg, fs)
	for _, w := range append(warnings, applyWarnings...) {
		logger.Info("Warning: config file setting not honoured", "file", o.ConfigFile, "field", w.Field, "reason", w.Message)
	}
	if err != nil {
		return fmt.Errorf("config file %s:\n%w", o.ConfigFile, err)
	}
	logger.V(2).Info("Loaded the config file", "file", o.ConfigFile)
	return nil
}

// writeConfig writes the effective configuration to --write-config-to.
func (o *Options) writeConfig(fs *pflag.FlagSet, logger klog.Logger) error {
	cfg, warnings := o.ProxyConfig(fs)
	for _, w := range warnings {
		logger.Info("Warning: option not written to the config file", "field", w.Field, "reason", w.Message)
	}
	if err := WriteProxyConfig(o.WriteConfigTo, cfg); err != nil {
		return err
	}
	logger.Info("Wrote the effective configuration", "file", o.WriteConfigTo)
	return nil
}
