package cluster

import "testing"

func TestParseTarget(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    target
		wantErr bool
	}{
		{name: "client", in: "client", want: target{NetNS: ClientNetNS}},
		{name: "control plane", in: "control-plane", want: target{NetNS: ControlPlaneNetNS}},
		{name: "control plane, short", in: "cp", want: target{NetNS: ControlPlaneNetNS}},
		{name: "node", in: "node-2", want: target{NetNS: "kpc-node-2"}},
		{name: "node beyond the cluster is a pod name", in: "node-3", want: target{PodNamespace: "default", PodName: "node-3"}},
		{name: "pod in default", in: "web-abc", want: target{PodNamespace: "default", PodName: "web-abc"}},
		{name: "pod in a namespace", in: "kube-system/dns-1", want: target{PodNamespace: "kube-system", PodName: "dns-1"}},
		{name: "pod named client, by namespace", in: "default/client", want: target{PodNamespace: "default", PodName: "client"}},
		{name: "empty", in: "", wantErr: true},
		{name: "empty namespace", in: "/web", wantErr: true},
		{name: "empty pod name", in: "default/", wantErr: true},
		{name: "two slashes", in: "a/b/c", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseTarget(tc.in, 2)
			if (err != nil) != tc.wantErr {
				t.Fatalf("parseTarget(%q) error = %v, want error %t", tc.in, err, tc.wantErr)
			}
			if got != tc.want {
				t.Errorf("parseTarget(%q) = %+v, want %+v", tc.in, got, tc.want)
			}
		})
	}
}
