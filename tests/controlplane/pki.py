"""The test cluster's certificates and keys, made the way envtest and kubeadm make them.

One CA signs the API server's serving certificate and every client certificate; the API server
trusts client certificates from that CA (`--client-ca-file`), so an identity is a certificate
whose CN is the user and whose O entries are the groups. The built-in identities get the
bootstrap RBAC roles the API server creates at start-up (rbac/bootstrappolicy in
k8s.io/kubernetes/plugin/pkg/auth/authorizer/rbac): `system:kube-controller-manager`,
`system:kube-scheduler`, `system:node:<name>` in `system:nodes` (with the Node authorizer), and
the test's admin in `system:masters`. ServiceAccount tokens are signed by the API server with
`service_account_key` (`--service-account-signing-key-file`), as on any cluster.

EC P-256 keys: a cluster's worth of them is made in milliseconds (RSA 2048 takes ~50 ms each).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=2)
"""A test cluster lives for one pytest session; two days covers a clock that moves meanwhile."""


@dataclass(frozen=True)
class Credential:
    """A key pair on disk: the certificate (PEM) and its private key (PEM)."""

    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def _name(common_name: str, groups: tuple[str, ...] = ()) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
    return x509.Name([*parts, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class ClusterPKI:
    """A CA in `directory` and the certificates it issues there."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._ca_key = _key()
        now = datetime.datetime.now(datetime.UTC)
        name = _name("llamaft-test-ca")
        self._ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._ca_key, hashes.SHA256())
        )
        self.ca = directory / "ca.crt"
        self.ca.write_bytes(self._ca_cert.public_bytes(serialization.Encoding.PEM))
        # The key that signs ServiceAccount tokens (--service-account-signing-key-file) and the
        # public half that verifies them (--service-account-key-file), as kubeadm's sa.key/sa.pub.
        signer = _key()
        self.service_account_key = _write_key(signer, directory / "service-account.key")
        self.service_account_public_key = directory / "service-account.pub"
        self.service_account_public_key.write_bytes(signer.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))

    def _issue(self, stem: str, subject: x509.Name, usage: x509.ObjectIdentifier,
               hosts: tuple[str, ...] = ()) -> Credential:
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if hosts:
            names: list[x509.GeneralName] = []
            for host in hosts:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    names.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        path = self.directory / f"{stem}.crt"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Credential(path, _write_key(key, self.directory / f"{stem}.key"))

    def serving(self, stem: str, hosts: tuple[str, ...]) -> Credential:
        """A server certificate for `hosts` (IP addresses and DNS names)."""
        return self._issue(stem, _name(hosts[0]), ExtendedKeyUsageOID.SERVER_AUTH, hosts)

    def client(self, user: str, groups: tuple[str, ...] = ()) -> Credential:
        """A client certificate: the API server authenticates it as `user` in `groups`."""
        stem = user.replace(":", "-")
        return self._issue(stem, _name(user, groups), ExtendedKeyUsageOID.CLIENT_AUTH)
