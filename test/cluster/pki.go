package cluster

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"time"
)

// certValidity is how long the local cluster's certificates last: far
// beyond any run, short enough that a leaked one soon means nothing.
const certValidity = 30 * 24 * time.Hour

// apiServerDNSNames are the API server certificate's DNS names.
var apiServerDNSNames = []string{
	"kubernetes", "kubernetes.default", "kubernetes.default.svc",
	"kubernetes.default.svc.cluster.local", "localhost",
}

// apiServerIPs are the API server certificate's IP addresses: every address
// a client reaches it at (switch, host link, Service, loopback).
var apiServerIPs = []string{ControlPlaneIP, ControlPlaneHostSideIP, KubernetesServiceIP, "127.0.0.1"}

// pkiBundle is the local cluster's key material, PEM encoded.
type pkiBundle struct {
	CACert, CAKey         []byte
	ServerCert, ServerKey []byte
	// ServiceAccountKey signs service account tokens (RSA, PKCS#1);
	// ServiceAccountPub verifies them (PKIX).
	ServiceAccountKey, ServiceAccountPub []byte
}

// newPKI generates a CA, the API server's serving certificate signed by
// it, and the service account key pair.
func newPKI(now time.Time) (*pkiBundle, error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generating the CA key: %w", err)
	}
	caTmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: "kpc-ca", Organization: []string{"kpc"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(certValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := signCert(caTmpl, caTmpl, caKey.Public(), caKey)
	if err != nil {
		return nil, fmt.Errorf("self-signing the CA: %w", err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, fmt.Errorf("parsing the CA certificate: %w", err)
	}

	serverKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generating the API server key: %w", err)
	}
	serverTmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:   now.Add(-time.Hour),
		NotAfter:    now.Add(certValidity),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    apiServerDNSNames,
	}
	for _, s := range apiServerIPs {
		serverTmpl.IPAddresses = append(serverTmpl.IPAddresses, net.ParseIP(s))
	}
	serverDER, err := signCert(serverTmpl, caCert, serverKey.Public(), caKey)
	if err != nil {
		return nil, fmt.Errorf("signing the API server certificate: %w", err)
	}

	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, fmt.Errorf("generating the service account key: %w", err)
	}
	saPub, err := x509.MarshalPKIXPublicKey(saKey.Public())
	if err != nil {
		return nil, fmt.Errorf("encoding the service account public key: %w", err)
	}

	caKeyDER, err := x509.MarshalECPrivateKey(caKey)
	if err != nil {
		return nil, fmt.Errorf("encoding the CA key: %w", err)
	}
	serverKeyDER, err := x509.MarshalECPrivateKey(serverKey)
	if err != nil {
		return nil, fmt.Errorf("encoding the API server key: %w", err)
	}
	return &pkiBundle{
		CACert:            pemBlock("CERTIFICATE", caDER),
		CAKey:             pemBlock("EC PRIVATE KEY", caKeyDER),
		ServerCert:        pemBlock("CERTIFICATE", serverDER),
		ServerKey:         pemBlock("EC PRIVATE KEY", serverKeyDER),
		ServiceAccountKey: pemBlock("RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(saKey)),
		ServiceAccountPub: pemBlock("PUBLIC KEY", saPub),
	}, nil
}

// signCert signs tmpl with a fresh random serial.
func signCert(tmpl, parent *x509.Certificate, pub crypto.PublicKey, signer crypto.Signer) ([]byte, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("generating a serial number: %w", err)
	}
	tmpl.SerialNumber = serial
	return x509.CreateCertificate(rand.Reader, tmpl, parent, pub, signer)
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

// newToken returns a random bearer token.
func newToken() (string, error) {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("generating a token: %w", err)
	}
	return hex.EncodeToString(b), nil
}
