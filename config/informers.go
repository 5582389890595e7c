package config

import (
	"errors"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
)

const (
	// LabelServiceProxyName marks a Service as handled by the named proxy
	// instead of the default one.
	LabelServiceProxyName = "service.kubernetes.io/service-proxy-name"
	// LabelHeadless is set by the EndpointSlice controller on the slices of
	// headless Services.
	LabelHeadless = v1.IsHeadlessService
)

// InformerOptions configures NewInformerFactories.
type InformerOptions struct {
	Client kubernetes.Interface
	// NodeName is the node kproxy runs on: the Node informer watches that
	// Node only (OtherNodesConfig watches the others' labels when needed).
	NodeName string
	// ResyncPeriod is the factories' default resync period (0: no resync).
	ResyncPeriod time.Duration
	// ServiceProxyName, when set, selects exactly the Services labelled
	// LabelServiceProxyName=ServiceProxyName; when empty, those without the
	// label. It must be a valid label value.
	ServiceProxyName string
}

// ServiceSelector returns the label selector kproxy applies to Services:
// those handled by this proxy, unlabelled when serviceProxyName is empty,
// labelled with exactly serviceProxyName otherwise. The error reports an
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
	return labels.NewSelector().Add(*proxyName), nil
}

// NodeFieldSelector returns the field selector of the Node informer: this
// node only, as kube-proxy watches it.
func NodeFieldSelector(nodeName string) fields.Selector {
	return fields.OneTermEqualSelector("metadata.name", nodeName)
}

// ServiceFieldSelector returns the field selector kproxy applies to
// Services: headless ones (spec.clusterIP "None") are left out by the API
// server. ServiceConfig skips them too, for API servers and fakes that do
// not apply the selector.
func ServiceFieldSelector() fields.Selector {
	return fields.OneTermNotEqualSelector("spec.clusterIP", v1.ClusterIPNone)
}

// EndpointSliceSelector returns the label selector kproxy applies to
// EndpointSlices: those not of a headless Service. As in kube-proxy, the
// service-proxy-name label is not looked at: a slice of a Service this proxy
// does not handle has no service port to attach to and programs nothing.
func EndpointSliceSelector() labels.Selector {
	notHeadless, err := labels.NewRequirement(LabelHeadless, selection.DoesNotExist, nil)
	if err != nil {
		// The key is a constant valid label key.
		panic(fmt.Sprintf("building the %s requirement: %v", LabelHeadless, err))
	}
	return labels.NewSelector().Add(*notHeadless)
}

// InformerFactories are the shared informer factories kproxy watches
// through, one per selector, as upstream kube-proxy has them.
type InformerFactories struct {
	// Services is filtered by ServiceSelector and ServiceFieldSelector.
	Services informers.SharedInformerFactory
	// EndpointSlices is filtered by EndpointSliceSelector.
	EndpointSlices informers.SharedInformerFactory
	// Nodes is filtered by NodeFieldSelector: this node's Node only.
	Nodes informers.SharedInformerFactory
}

// Start starts every informer requested from the factories so far.
func (f *InformerFactories) Start(stop <-chan struct{}) {
	f.Services.Start(stop)
	f.EndpointSlices.Start(stop)
	f.Nodes.Start(stop)
}

// Shutdown waits for the factories' informers to stop; call it after the
// channel given to Start is closed.
func (f *InformerFactories) Shutdown() {
	f.Services.Shutdown()
	f.EndpointSlices.Shutdown()
	f.Nodes.Shutdown()
}

// NewInformerFactories builds the informer factories of opts. None is
// started. Each factory trims the objects it caches to what kproxy reads
// (see transformService, sliceTrimmer and transformNode).
func NewInformerFactories(opts InformerOptions) (*InformerFactories, error) {
	if opts.Client == nil {
		return nil, errors.New("building informer factories: no client")
	}
	if opts.NodeName == "" {
		return nil, errors.New("building informer factories: no node name")
	}
	serviceSelector, err := ServiceSelector(opts.ServiceProxyName)
	if err != nil {
		return nil, fmt.Errorf("building informer factories: %w", err)
	}
	serviceLabels, serviceFields := serviceSelector.String(), ServiceFieldSelector().String()
	sliceLabels := EndpointSliceSelector().String()
	nodeFields := NodeFieldSelector(opts.NodeName).String()
	return &InformerFactories{
		Services: informers.NewSharedInformerFactoryWithOptions(opts.Client, opts.ResyncPeriod,
			informers.WithTransform(transformService),
			informers.WithTweakListOptions(func(options *metav1.ListOptions) {
				options.LabelSelector = serviceLabels
				options.FieldSelector = serviceFields
			})),
		EndpointSlices: informers.NewSharedInformerFactoryWithOptions(opts.Client, opts.ResyncPeriod,
			informers.WithTransform(newSliceTrimmer().transform),
			informers.WithTweakListOptions(func(options *metav1.ListOptions) {
				options.LabelSelector = sliceLabels
			})),
		Nodes: informers.NewSharedInformerFactoryWithOptions(opts.Client, opts.ResyncPeriod,
			informers.WithTransform(transformNode),
			informers.WithTweakListOptions(func(options *metav1.ListOptions) {
				options.FieldSelector = nodeFields
			})),
	}, nil
}
