package cluster

import (
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"testing"
	"time"
)

func parseCertPEM(t *testing.T, data []byte) *x509.Certificate {
	t.Helper()
	b, _ := pem.Decode(data)
	if b == nil || b.Type != "CERTIFICATE" {
		t.Fatalf("not a PEM certificate: %q", data)
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatalf("parsing certificate: %v", err)
	}
	return c
}

func TestNewPKI(t *testing.T) {
	now := time.Now()
	p, err := newPKI(now)
	if err != nil {
		t.Fatalf("newPKI: %v", err)
	}
	ca := parseCertPEM(t, p.CACert)
	server := parseCertPEM(t, p.ServerCert)
	if !ca.IsCA {
		t.Errorf("CA certificate is not a CA")
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)

	// The serving certificate verifies for every name clients use.
	tests := []struct{ name, host string }{
		{name: "control plane on the switch", host: ControlPlaneIP},
		{name: "control plane from the host", host: ControlPlaneHostSideIP},
		{name: "kubernetes Service", host: KubernetesServiceIP},
		{name: "loopback in the control plane", host: "127.0.0.1"},
		{name: "in-cluster DNS name", host: "kubernetes.default.svc"},
		{name: "full DNS name", host: "kubernetes.default.svc.cluster.local"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := server.Verify(x509.VerifyOptions{
				DNSName: tc.host, Roots: roots, CurrentTime: now,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			})
			if err != nil {
				t.Errorf("server certificate does not verify for %s: %v", tc.host, err)
			}
		})
	}
	t.Run("not for other names", func(t *testing.T) {
		if _, err := server.Verify(x509.VerifyOptions{DNSName: "10.254.0.11", Roots: roots, CurrentTime: now}); err == nil {
			t.Errorf("server certificate verifies for a node address")
		}
	})

	t.Run("keys match", func(t *testing.T) {
		for _, pair := range []struct {
			name      string
			cert, key []byte
		}{
			{name: "CA", cert: p.CACert, key: p.CAKey},
			{name: "server", cert: p.ServerCert, key: p.ServerKey},
		} {
			b, _ := pem.Decode(pair.key)
			if b == nil {
				t.Fatalf("%s key is not PEM", pair.name)
			}
			key, err := x509.ParseECPrivateKey(b.Bytes)
			if err != nil {
				t.Fatalf("%s key: %v", pair.name, err)
			}
			if !key.PublicKey.Equal(parseCertPEM(t, pair.cert).PublicKey) {
				t.Errorf("%s key does not match its certificate", pair.name)
			}
		}
	})

	t.Run("service account key pair", func(t *testing.T) {
		b, _ := pem.Decode(p.ServiceAccountKey)
		if b == nil || b.Type != "RSA PRIVATE KEY" {
			t.Fatalf("service account key is not an RSA PEM key")
		}
		key, err := x509.ParsePKCS1PrivateKey(b.Bytes)
		if err != nil {
			t.Fatalf("service account key: %v", err)
		}
		pb, _ := pem.Decode(p.ServiceAccountPub)
		if pb == nil {
			t.Fatalf("service account public key is not PEM")
		}
		pub, err := x509.ParsePKIXPublicKey(pb.Bytes)
		if err != nil {
			t.Fatalf("service account public key: %v", err)
		}
		if rp, ok := pub.(*rsa.PublicKey); !ok || !rp.Equal(&key.PublicKey) {
			t.Errorf("service account public key does not match the private key")
		}
	})
}

func TestNewToken(t *testing.T) {
	seen := map[string]bool{}
	for i := range 20 {
		tok, err := newToken()
		if err != nil {
			t.Fatalf("newToken: %v", err)
		}
		if len(tok) < 32 || seen[tok] {
			t.Fatalf("token %d %q is short or repeated", i, tok)
		}
		seen[tok] = true
	}
}

func nowForTest() time.Time { return time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC) }
