package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
)

// deployDir holds kproxy's deployment manifests.
var deployDir = filepath.Join("..", "..", "hack", "deploy")

// deployObjects reads every object of hack/deploy/*.yaml, in file order.
func deployObjects(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(deployDir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatalf("no manifests in %s", deployDir)
	}
	sort.Strings(files)
	var out []*unstructured.Unstructured
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
		for {
			var m map[string]any
			err := dec.Decode(&m)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			if len(m) == 0 {
				continue // an empty document
			}
			out = append(out, &unstructured.Unstructured{Object: m})
		}
	}
	return out
}

// deployClients returns a dynamic client and a REST mapper of the suite's
// cluster.
func deployClients(t *testing.T) (dynamic.Interface, meta.RESTMapper) {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", suiteCluster.Kubeconfig())
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	k, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	groups, err := restmapper.GetAPIGroupResources(k.Discovery())
	if err != nil {
		t.Fatalf("discovering the API: %v", err)
	}
	return dyn, restmapper.NewDiscoveryRESTMapper(groups)
}

// resourceFor returns the client of obj's resource, in its namespace when
// the resource is namespaced.
func resourceFor(dyn dynamic.Interface, mapper meta.RESTMapper, obj *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := obj.GroupVersionKind()
	m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", gvk, err)
	}
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		return dyn.Resource(m.Resource).Namespace(obj.GetNamespace()), nil
	}
	return dyn.Resource(m.Resource), nil
}

func describe(obj *unstructured.Unstructured) string {
	if ns := obj.GetNamespace(); ns != "" {
		return fmt.Sprintf("%s %s/%s", obj.GetKind(), ns, obj.GetName())
	}
	return obj.GetKind() + " " + obj.GetName()
}

// TestDeployManifestsDryRun creates every object of hack/deploy on the
// local cluster's API server with a server-side dry run and strict field
// validation: the API server's schemas, defaulting, validation and
// admission judge the manifests, and nothing is stored. It then checks the
// DaemonSet as the server returned it, and that the RBAC rules grant
// kproxy's ServiceAccount what kproxy does, and no more.
func TestDeployManifestsDryRun(t *testing.T) {
	runsOnce(t)
	if skipReason != "" {
		t.Skip(skipReason)
	}
	if suiteCluster == nil {
		t.Fatal("no cluster: the suite's TestMain did not bring one up")
	}
	ctx := t.Context()
	objs := deployObjects(t)
	dyn, mapper := deployClients(t)

	var kinds []string
	created := map[string]*unstructured.Unstructured{}
	for _, obj := range objs {
		kinds = append(kinds, obj.GetKind())
		if ns := obj.GetNamespace(); obj.GetKind() != "ClusterRole" && obj.GetKind() != "ClusterRoleBinding" && ns != metav1.NamespaceSystem {
			t.Errorf("%s: namespace %q, want %s", describe(obj), ns, metav1.NamespaceSystem)
		}
		res, err := resourceFor(dyn, mapper, obj)
		if err != nil {
			t.Fatal(err)
		}
		got, err := res.Create(ctx, obj, metav1.CreateOptions{
			DryRun:          []string{metav1.DryRunAll},
			FieldValidation: metav1.FieldValidationStrict,
		})
		if err != nil {
			t.Errorf("dry-run create of %s: %v", describe(obj), err)
			continue
		}
		created[obj.GetKind()] = got
	}
	slices.Sort(kinds)
	if want := []string{"ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "ServiceAccount"}; !slices.Equal(kinds, want) {
		t.Errorf("hack/deploy holds %v, want one each of %v", kinds, want)
	}
	if t.Failed() {
		return
	}

	t.Run("nothing stored", func(t *testing.T) {
		for _, obj := range objs {
			res, err := resourceFor(dyn, mapper, obj)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := res.Get(ctx, obj.GetName(), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				t.Errorf("%s after a dry run: got err %v, want NotFound", describe(obj), err)
			}
		}
	})

	t.Run("DaemonSet as the server defaulted it", func(t *testing.T) {
		var ds appsv1.DaemonSet
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(created["DaemonSet"].Object, &ds); err != nil {
			t.Fatal(err)
		}
		checkDaemonSet(t, &ds, created["ServiceAccount"].GetName(), created["ConfigMap"])
	})

	t.Run("RBAC grants what kproxy needs and no more", func(t *testing.T) {
		checkRBAC(t, dyn, mapper, objs)
	})
}

// checkDaemonSet checks the properties kproxy's DaemonSet must have.
func checkDaemonSet(t *testing.T, ds *appsv1.DaemonSet, serviceAccount string, cm *unstructured.Unstructured) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	if spec.ServiceAccountName != serviceAccount {
		t.Errorf("serviceAccountName %q, want %q", spec.ServiceAccountName, serviceAccount)
	}
	if !spec.HostNetwork {
		t.Error("not hostNetwork")
	}
	if spec.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q", spec.PriorityClassName)
	}
	if !slices.ContainsFunc(spec.Tolerations, func(tol v1.Toleration) bool {
		return tol.Operator == v1.TolerationOpExists && tol.Key == "" && tol.Effect == ""
	}) {
		t.Errorf("tolerations %v do not tolerate every taint", spec.Tolerations)
	}
	if s := ds.Spec.UpdateStrategy; s.Type != appsv1.RollingUpdateDaemonSetStrategyType || s.RollingUpdate == nil ||
		s.RollingUpdate.MaxUnavailable == nil || *s.RollingUpdate.MaxUnavailable != intstr.FromInt32(1) {
		t.Errorf("updateStrategy %+v, want RollingUpdate with maxUnavailable 1", s)
	}
	if len(spec.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(spec.Containers))
	}
	c := spec.Containers[0]
	if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
		t.Error("the container is not privileged")
	}
	if c.Image != "kproxy:dev" {
		t.Errorf("image %q, want kproxy:dev (hack/kind-e2e.sh patches that name)", c.Image)
	}
	if !slices.Contains(c.Args, "--hostname-override=$(NODE_NAME)") {
		t.Errorf("args %v lack --hostname-override=$(NODE_NAME)", c.Args)
	}
	if !slices.ContainsFunc(c.Env, func(e v1.EnvVar) bool {
		return e.Name == "NODE_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName"
	}) {
		t.Errorf("env %v lacks NODE_NAME from spec.nodeName", c.Env)
	}
	for _, p := range []struct {
		name  string
		probe *v1.Probe
		path  string
	}{{"liveness", c.LivenessProbe, "/livez"}, {"readiness", c.ReadinessProbe, "/healthz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path || p.probe.HTTPGet.Port != intstr.FromInt32(10256) {
			t.Errorf("%s probe %+v, want GET %s on port 10256", p.name, p.probe, p.path)
		}
	}

	// The --config path is the ConfigMap's config.conf where it is mounted.
	volumes := map[string]v1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	mounts := map[string]v1.VolumeMount{}
	for _, m := range c.VolumeMounts {
		mounts[m.MountPath] = m
		if _, ok := volumes[m.Name]; !ok {
			t.Errorf("mount %s of a missing volume %q", m.MountPath, m.Name)
		}
	}
	var config string
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, "--config="); ok {
			config = v
		}
	}
	m, ok := mounts[filepath.Dir(config)]
	switch {
	case config == "":
		t.Errorf("args %v lack --config", c.Args)
	case !ok:
		t.Errorf("--config=%s is not under any mount", config)
	case volumes[m.Name].ConfigMap == nil || volumes[m.Name].ConfigMap.Name != cm.GetName():
		t.Errorf("--config=%s: volume %q is not ConfigMap %s", config, m.Name, cm.GetName())
	default:
		if data, _, _ := unstructured.NestedStringMap(cm.Object, "data"); data[filepath.Base(config)] == "" {
			t.Errorf("--config=%s: ConfigMap %s has no key %s", config, cm.GetName(), filepath.Base(config))
		}
	}
	for _, hp := range []struct {
		path string
		typ  v1.HostPathType
	}{{"/run/xtables.lock", v1.HostPathFileOrCreate}, {"/lib/modules", v1.HostPathDirectory}} {
		m, ok := mounts[hp.path]
		if !ok {
			t.Errorf("no mount at %s", hp.path)
			continue
		}
		src := volumes[m.Name].HostPath
		if src == nil || src.Path != hp.path || src.Type == nil || *src.Type != hp.typ {
			t.Errorf("mount %s: volume %+v, want hostPath %s (%s)", hp.path, volumes[m.Name], hp.path, hp.typ)
		}
	}
	if m := mounts["/lib/modules"]; !m.ReadOnly {
		t.Error("/lib/modules is mounted read-write")
	}
}

// checkRBAC stores the ServiceAccount, ClusterRole and ClusterRoleBinding
// for real (removed at the end of the test), then asks the API server's
// authorizer what the ServiceAccount may do.
func checkRBAC(t *testing.T, dyn dynamic.Interface, mapper meta.RESTMapper, objs []*unstructured.Unstructured) {
	ctx := t.Context()
	var sa *unstructured.Unstructured
	for _, obj := range objs {
		switch obj.GetKind() {
		case "ServiceAccount":
			sa = obj
		case "ClusterRole", "ClusterRoleBinding":
		default:
			continue
		}
		res, err := resourceFor(dyn, mapper, obj)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := res.Create(ctx, obj, metav1.CreateOptions{FieldValidation: metav1.FieldValidationStrict}); err != nil {
			t.Fatalf("creating %s: %v", describe(obj), err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := res.Delete(ctx, obj.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("deleting %s: %v", describe(obj), err)
			}
		})
	}
	if sa == nil {
		t.Fatal("no ServiceAccount in hack/deploy")
	}
	user := fmt.Sprintf("system:serviceaccount:%s:%s", sa.GetNamespace(), sa.GetName())
	groups := []string{"system:serviceaccounts", "system:serviceaccounts:" + sa.GetNamespace(), "system:authenticated"}
	k := suiteCluster.Client()
	type access struct{ group, resource, verb string }
	allowed := func(a access) (bool, error) {
		sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User: user, Groups: groups,
			ResourceAttributes: &authorizationv1.ResourceAttributes{Group: a.group, Resource: a.resource, Verb: a.verb},
		}}
		got, err := k.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
		if err != nil {
			return false, err
		}
		return got.Status.Allowed, nil
	}
	want := []access{
		{"", "services", "list"}, {"", "services", "watch"},
		{"discovery.k8s.io", "endpointslices", "list"}, {"discovery.k8s.io", "endpointslices", "watch"},
		{"", "nodes", "list"}, {"", "nodes", "watch"}, {"", "nodes", "get"},
		{"", "events", "create"}, {"", "events", "patch"},
		{"events.k8s.io", "events", "create"}, {"events.k8s.io", "events", "patch"},
	}
	// Bindings are cached by the authorizer: wait for the new ones.
	deadline := time.Now().Add(programTimeout)
	for {
		ok, err := allowed(want[0])
		if err != nil {
			t.Fatalf("SubjectAccessReview: %v", err)
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still may not %v after %s", user, want[0], programTimeout)
		}
		time.Sleep(pollInterval)
	}
	for _, a := range want {
		if ok, err := allowed(a); err != nil || !ok {
			t.Errorf("%s may not %s %s.%s (err %v): kproxy needs it", user, a.verb, a.resource, a.group, err)
		}
	}
	for _, a := range []access{
		{"", "services", "get"}, {"", "services", "update"}, {"", "services", "delete"},
		{"discovery.k8s.io", "endpointslices", "create"}, {"discovery.k8s.io", "endpointslices", "delete"},
		{"", "nodes", "update"}, {"", "nodes", "patch"}, {"", "nodes", "delete"},
		{"", "pods", "list"}, {"", "secrets", "get"}, {"", "secrets", "list"}, {"", "configmaps", "list"},
		{"", "events", "delete"}, {"", "events", "list"},
	} {
		if ok, err := allowed(a); err != nil || ok {
			t.Errorf("%s may %s %s.%s (err %v): more than kproxy needs", user, a.verb, a.resource, a.group, err)
		}
	}
}

// deployConfigConf returns the config.conf of hack/deploy's ConfigMap.
func deployConfigConf(t *testing.T) string {
	t.Helper()
	for _, obj := range deployObjects(t) {
		if obj.GetKind() != "ConfigMap" {
			continue
		}
		data, _, err := unstructured.NestedStringMap(obj.Object, "data")
		if err != nil {
			t.Fatal(err)
		}
		if conf, ok := data["config.conf"]; ok {
			return conf
		}
	}
	t.Fatal("no ConfigMap with a config.conf in hack/deploy")
	return ""
}

// getInNetNS sends GET http://addr+path from inside from's network
// namespace and returns the status code and body.
func (e *env) getInNetNS(from, addr, path string) (int, string, error) {
	ns, err := e.netnsOf(from)
	if err != nil {
		return 0, "", err
	}
	tr := &http.Transport{DialContext: func(ctx context.Context, network, a string) (net.Conn, error) {
		return ns.Dial(ctx, network, a)
	}}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(e.ctx, requestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, string(body), err
}

// TestKproxyConfigFile runs kproxy on one node as the DaemonSet does, with
// --config holding hack/deploy's config.conf, changed in one way the test
// can observe: the metrics port. kproxy must load the file without a
// warning, serve metrics on the file's port (and not on the default one),
// and route Services as before. The cluster's own flags (--kubeconfig,
// --cluster-cidr, --proxy-mode) stay and override the file.
func TestKproxyConfigFile(t *testing.T) { inMode(t, testKproxyConfigFile) }

func testKproxyConfigFile(t *testing.T) {
	const (
		node        = 2
		filePort    = "10349"
		defaultPort = "10249"
	)
	e := newEnv(t)
	conf := deployConfigConf(t)
	changed := strings.Replace(conf, "metricsBindAddress: 127.0.0.1:"+defaultPort, "metricsBindAddress: 127.0.0.1:"+filePort, 1)
	if changed == conf {
		t.Fatalf("hack/deploy's config.conf has no metricsBindAddress: 127.0.0.1:%s line to change:\n%s", defaultPort, conf)
	}
	path := filepath.Join(t.TempDir(), "config.conf")
	if err := os.WriteFile(path, []byte(changed), 0o600); err != nil {
		t.Fatal(err)
	}

	pods := e.deploy(workload{name: "web", replicas: 2})
	svc := e.createService("web", map[string]string{"app": "web"})
	e.waitEndpoints(svc.Name, "2 ready", readyCount(2))
	clusterIP := hostPort(svc.Spec.ClusterIP, servicePort)

	name := nodeName(node)
	offset := logSize(e.c.KproxyLog(name))
	if err := e.c.StopKproxy(e.ctx, name); err != nil {
		e.fatalf("stopping kproxy on %s: %v", name, err)
	}
	// Whatever happens, the node gets its usual kproxy back (no --config)
	// for the other tests.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := e.c.StopKproxy(ctx, name); err != nil {
			t.Errorf("stopping kproxy on %s: %v", name, err)
		}
		if err := e.c.StartKproxy(ctx, name); err != nil {
			t.Errorf("restarting kproxy on %s: %v", name, err)
		}
	})
	if err := e.c.StartKproxy(e.ctx, name, "--config="+path); err != nil {
		e.fatalf("starting kproxy on %s with --config: %v", name, err)
	}
	e.kproxySynced(name, offset)

	e.eventually("metrics on the config file's port", programTimeout, func() error {
		code, body, err := e.getInNetNS(name, "127.0.0.1:"+filePort, "/proxyMode")
		if err != nil {
			return err
		}
		if code != http.StatusOK || body != e.c.Mode() {
			return fmt.Errorf("/proxyMode answered %d %q, want 200 %q", code, body, e.c.Mode())
		}
		return nil
	})
	if _, _, err := e.getInNetNS(name, "127.0.0.1:"+defaultPort, "/proxyMode"); err == nil {
		e.fatalf("a metrics server still answers on the default port %s: the file's metricsBindAddress was not used", defaultPort)
	}
	e.expectTraffic(name, "tcp", clusterIP, 20, expect{all: names(pods, "")})

	logged, err := os.ReadFile(e.c.KproxyLog(name))
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(logged)) >= offset {
		logged = logged[offset:]
	}
	if !strings.Contains(string(logged), `"Loaded the config file"`) {
		t.Errorf("kproxy's log on %s does not show the config file loaded", name)
	}
	for line := range strings.SplitSeq(string(logged), "\n") {
		if strings.Contains(line, "not honoured") {
			t.Errorf("kproxy warned about hack/deploy's config.conf: %s", line)
		}
	}
}
