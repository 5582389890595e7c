package config

import (
	"errors"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
)

const (
	// LabelServiceProxyName marks a Service (and, copied by the EndpointSlice
	// controller, its EndpointSlices) as handled by the named proxy instead
	// of the default one.
	LabelServiceProxyName = "service.kubernetes.io/service-proxy-name"
	// LabelHeadless is set by the EndpointSlice controller on the slices of
	// headless Services.
	LabelHeadless = v1.IsHeadlessService
)

// InformerOptions configures NewInformerFactories.
type InformerOptions struct {
	Client kubernetes.Interface
	// ResyncPeriod is the factories' default resync period (0: no resync).
	ResyncPeriod time.Duration
	// ServiceProxyName, when set, selects exactly the Services and
	// EndpointSlices labelled LabelServiceProxyName=ServiceProxyName; when
	// empty, those without the label. It must be a valid label value.
	ServiceProxyName string
}

// ServiceSelector returns the label selector kproxy applies to Services and
// EndpointSlices: objects handled by this proxy (unlabelled when
// serviceProxyName is empty, labelled with exactly serviceProxyName
// otherwise) that do not belong to a headless Service. The error reports an
// invalid label value.
func ServiceSelector(serviceProxyName string) (labels.Selector, error) {
	proxyOp, proxyValues := selection.DoesNotExist, []string(nil)
	if serviceProxyName != "" {
		proxyOp, proxyValues = selection.Equals, []string{serviceProxyName}
	}
	proxyName, err := labels.NewRequirement(LabelServiceProxyName, proxyOp, proxyValues)
	if err != nil {
		return nil, fmt.Errorf("invalid service proxy name %q: %w", serviceProxyName, err)
	}
	notHeadless, err := labels.NewRequirement(LabelHeadless, selection.DoesNotExist, nil)
	if err != nil {
		return nil, fmt.Errorf("building %s requirement: %w", LabelHeadless, err)
	}
	return labels.NewSelector().Add(*proxyName, *notHeadless), nil
}

// NewInformerFactories builds the two shared informer factories kproxy
// watches through, as upstream kube-proxy does: services, filtered by
// ServiceSelector, for Services and EndpointSlices (the EndpointSlice
// controller copies Service labels onto slices, so one selector serves
// both); and nodes, unfiltered, for Nodes. Neither factory is started.
func NewInformerFactories(opts InformerOptions) (services, nodes informers.SharedInformerFactory, err error) {
	if opts.Client == nil {
		return nil, nil, errors.New("building informer factories: no client")
	}
	selector, err := ServiceSelector(opts.ServiceProxyName)
	if err != nil {
		return nil, nil, fmt.Errorf("building informer factories: %w", err)
	}
	selectorString := selector.String()
	services = informers.NewSharedInformerFactoryWithOptions(opts.Client, opts.ResyncPeriod,
		informers.WithTweakListOptions(func(options *metav1.ListOptions) {
			options.LabelSelector = selectorString
		}))
	nodes = informers.NewSharedInformerFactory(opts.Client, opts.ResyncPeriod)
	return services, nodes, nil
}
