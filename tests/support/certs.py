"""Real X.509 certificates made at test time: a CA, a server certificate for 127.0.0.1 and
localhost, client certificates, and a second CA whose certificates the first one rejects."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files and bytes."""

    cert: Path
    key: Path

    @property
    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key.read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key) -> Issued:
    directory.mkdir(parents=True, exist_ok=True)
    c, k = directory / f"{stem}.crt", directory / f"{stem}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return Issued(c, k)


def make_ca(directory: Path, common_name: str = "specstream test CA") -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name))
            .issuer_name(_name(common_name)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return _write(directory, "ca", cert, key)


def issue(ca: Issued, directory: Path, stem: str, common_name: str, *, server: bool) -> Issued:
    """A leaf certificate signed by `ca`: a server's (SAN 127.0.0.1, localhost) or a client's."""
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder().subject_name(_name(common_name))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return _write(directory, stem, builder.sign(ca_key, hashes.SHA256()), key)


def serial_of(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


@dataclass(frozen=True)
class Pki:
    ca: Issued
    server: Issued
    client: Issued
    other_ca: Issued             # an unrelated CA
    stranger: Issued             # a client certificate the server's client CA did not sign


def make_pki(directory: Path) -> Pki:
    ca = make_ca(directory / "ca")
    other = make_ca(directory / "other", "someone else's CA")
    return Pki(ca, issue(ca, directory, "server", "specstream server", server=True),
               issue(ca, directory, "client", "specstream client", server=False),
               other, issue(other, directory, "stranger", "stranger", server=False))
