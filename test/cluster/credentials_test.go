package cluster

import (
	"bytes"
	"encoding/csv"
	"slices"
	"testing"

	"k8s.io/client-go/tools/clientcmd"
)

func TestTokenFile(t *testing.T) {
	tests := []struct {
		name string
		ids  []identity
		want [][]string
	}{
		{
			name: "no groups",
			ids:  []identity{{Token: "t1", User: "system:kube-proxy", UID: "u1"}},
			want: [][]string{{"t1", "system:kube-proxy", "u1"}},
		},
		{
			name: "several groups in one quoted field",
			ids: []identity{
				{Token: "t1", User: "kpc-admin", UID: "u1", Groups: []string{"system:masters"}},
				{Token: "t2", User: "system:node:node-1", UID: "u2", Groups: []string{"system:nodes", "system:masters"}},
			},
			want: [][]string{
				{"t1", "kpc-admin", "u1", "system:masters"},
				{"t2", "system:node:node-1", "u2", "system:nodes,system:masters"},
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			data, err := tokenFile(tc.ids)
			if err != nil {
				t.Fatalf("tokenFile: %v", err)
			}
			// Read it back as the API server does: CSV, variable fields.
			r := csv.NewReader(bytes.NewReader(data))
			r.FieldsPerRecord = -1
			got, err := r.ReadAll()
			if err != nil {
				t.Fatalf("reading back %q: %v", data, err)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("records %q, want %q", got, tc.want)
			}
			for i := range got {
				if !slices.Equal(got[i], tc.want[i]) {
					t.Errorf("record %d = %q, want %q", i, got[i], tc.want[i])
				}
			}
		})
	}
}

func TestKubeconfigFor(t *testing.T) {
	p, err := newPKI(nowForTest())
	if err != nil {
		t.Fatalf("newPKI: %v", err)
	}
	tests := []struct {
		name, server, user, token string
	}{
		{name: "host", server: apiServerURL(ControlPlaneHostSideIP), user: adminUser, token: "admintoken"},
		{name: "node", server: apiServerURL(ControlPlaneIP), user: kproxyUser, token: "kproxytoken"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			data, err := kubeconfigFor(tc.server, p.CACert, tc.user, tc.token)
			if err != nil {
				t.Fatalf("kubeconfigFor: %v", err)
			}
			cfg, err := clientcmd.RESTConfigFromKubeConfig(data)
			if err != nil {
				t.Fatalf("loading the kubeconfig: %v", err)
			}
			if cfg.Host != tc.server {
				t.Errorf("host %q, want %q", cfg.Host, tc.server)
			}
			if cfg.BearerToken != tc.token {
				t.Errorf("token %q, want %q", cfg.BearerToken, tc.token)
			}
			if !bytes.Equal(cfg.CAData, p.CACert) {
				t.Errorf("CA data differs from the CA")
			}
			if cfg.Insecure {
				t.Errorf("kubeconfig skips TLS verification")
			}
		})
	}
}

func TestAPIServerURL(t *testing.T) {
	if got, want := apiServerURL(ControlPlaneHostSideIP), "https://10.254.1.2:6443"; got != want {
		t.Errorf("apiServerURL = %q, want %q", got, want)
	}
}
