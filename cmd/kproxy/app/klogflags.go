package app

import (
	"flag"

	"k8s.io/klog/v2"
)

// goFlagSet returns klog's flags (-v, --vmodule, ...) in their own set, so
// no global flag set is touched.
func goFlagSet() *flag.FlagSet {
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	return fs
}
