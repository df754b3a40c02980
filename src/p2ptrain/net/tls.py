"""Optional TLS: a self-signed certificate whose SHA-256 fingerprint is pinned in the node's
signed peer record (and in its address, ``https://host:port#sha256=<hex>``), so peers need
no certificate authority to know they reached the right key."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import os
import ssl
import tempfile
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["SelfSignedCertificate"]


@dataclass(frozen=True, slots=True)
class SelfSignedCertificate:
    cert_path: str
    key_path: str
    fingerprint: str  # hex SHA-256 of the DER certificate
    #: Kept in a node's directory (not removed when the node stops).
    kept: bool = False

    @classmethod
    def kept_in(cls, directory: str, host: str, days: int = 3650) -> SelfSignedCertificate:
        """The certificate kept in ``directory`` (``tls-cert.pem``, ``tls-key.pem``), made
        there the first time: a restarted node keeps its fingerprint, so the addresses that
        pin it stay good. (Peers check the pin, not the name, so a new host is fine.)"""
        cert_path = os.path.join(directory, "tls-cert.pem")
        key_path = os.path.join(directory, "tls-key.pem")
        if not (os.path.exists(cert_path) and os.path.exists(key_path)):
            made = cls.generate(host, days)
            os.makedirs(directory, exist_ok=True)
            os.replace(made.key_path, key_path)
            os.replace(made.cert_path, cert_path)
            made.remove()
        with open(cert_path, "rb") as handle:
            der = x509.load_pem_x509_certificate(handle.read()).public_bytes(
                serialization.Encoding.DER
            )
        return cls(cert_path, key_path, hashlib.sha256(der).hexdigest(), kept=True)

    @classmethod
    def generate(cls, host: str, days: int = 365) -> SelfSignedCertificate:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "p2ptrain node")])
        now = datetime.datetime.now(datetime.UTC)
        try:
            alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .sign(key, hashes.SHA256())
        )
        directory = tempfile.mkdtemp(prefix="p2ptrain-tls-")
        cert_path = os.path.join(directory, "cert.pem")
        key_path = os.path.join(directory, "key.pem")
        with open(cert_path, "wb") as out:
            out.write(cert.public_bytes(serialization.Encoding.PEM))
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
        return cls(cert_path, key_path, fingerprint)

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_path, self.key_path)
        return context

    def remove(self) -> None:
        """Delete a certificate made for one run (a kept one stays)."""
        if self.kept:
            return
        for path in (self.cert_path, self.key_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.cert_path))
