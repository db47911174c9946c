"""A kernel's own certificate authority, for the domains whose credentials the proxy adds.

To add a credential to an HTTPS request the proxy has to read the request: for the
domains a credential is bound to, and only those, it ends the kernel's TLS connection
with a certificate of a CA made for that one kernel, and opens its own to the real host.
The sandbox trusts the CA's certificate; the key stays on the host. The CA is
name-constrained to the kernel's allowed domains, so its key, were it ever to leak,
could not stand in for any other site.

Pure crypto (``cryptography``), no I/O but :meth:`KernelCA.save` and :meth:`KernelCA.load`.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sandbox_kernel.egress.rules import EgressRules, is_domain_name, normalize_host
from sandbox_kernel.errors import ConfigurationError

#: The CA (certificate and key) in a kernel's server-only runtime folder, never mounted.
CA_FILE = "egress-ca-and-key.pem"
#: How long a kernel's CA is valid; a persistent kernel may live for months.
CA_LIFETIME = datetime.timedelta(days=5 * 365)
#: How long a site certificate is valid, and how long before its end a new one is made.
LEAF_LIFETIME = datetime.timedelta(days=30)
LEAF_RENEWAL = datetime.timedelta(days=1)
#: Clocks disagree a little; certificates start this much before they are made.
BACKDATE = datetime.timedelta(hours=1)
#: A CA for a kernel with no allowed domains may sign for nothing real (RFC 6761's .invalid).
_NOTHING = "invalid"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class KernelCA:
    """One kernel's CA: its certificate (for the sandbox) and its key (for the host only)."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    @classmethod
    def create(cls, kernel_id: str, permitted: EgressRules) -> KernelCA:
        """A new CA that may sign only for the domains of ``permitted`` (the kernel's
        allowed domains) and their subdomains."""
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [x509.NameAttribute(NameOID.COMMON_NAME, f"sandbox-kernel egress CA {kernel_id[:8]}")]
        )
        domains = sorted({rule.domain for rule in permitted.rules}) or [_NOTHING]
        now = _now()
        public = key.public_key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + CA_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.NameConstraints(
                    permitted_subtrees=[x509.DNSName(d) for d in domains], excluded_subtrees=None
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def leaf(self, host: str) -> tuple[bytes, bytes]:
        """(certificate chain PEM, key PEM) of a site certificate for ``host``, valid for
        :data:`LEAF_LIFETIME`."""
        host = normalize_host(host)
        if not is_domain_name(host):
            msg = f"{host!r} is not a domain name: no certificate is made for it"
            raise ConfigurationError(msg)
        ca_cert = x509.load_pem_x509_certificate(self.cert_pem)
        ca_key = serialization.load_pem_private_key(self.key_pem, password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            msg = "the kernel's CA key is not an EC key"
            raise ConfigurationError(msg)
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(min(now + LEAF_LIFETIME, ca_cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM) + self.cert_pem, _key_pem(key)

    def save(self, path: Path) -> None:
        """Write certificate and key to ``path`` (0600, replaced atomically), in a folder
        only the server may read."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.cert_pem + self.key_pem)
        tmp.replace(path)

    @classmethod
    def of_kernel(cls, runtime_dir: Path, kernel_id: str, permitted: EgressRules) -> KernelCA:
        """The CA kept in a kernel's runtime folder; made (and kept there) the first time."""
        path = runtime_dir / CA_FILE
        if path.exists():
            return cls.load(path)
        ca = cls.create(kernel_id, permitted)
        ca.save(path)
        return ca

    @classmethod
    def load(cls, path: Path) -> KernelCA:
        """The CA :meth:`save` wrote; ConfigurationError if it is missing or not one."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            msg = f"Could not read the kernel's egress CA {path}: {exc.strerror or exc}"
            raise ConfigurationError(msg) from exc
        cert, marker, key = data.partition(b"-----END CERTIFICATE-----\n")
        if not marker or b"PRIVATE KEY" not in key:
            msg = f"{path} does not hold a kernel's egress CA (a certificate, then its key)"
            raise ConfigurationError(msg)
        return cls(cert + marker, key)


class LeafContexts:
    """Server-side TLS contexts for the hosts the proxy intercepts, signed by one kernel's
    CA: made on first use, remade when their certificate nears its end, at most ``limit``
    kept. HTTP/1.1 only (ALPN), TLS 1.2 or later."""

    def __init__(self, ca: KernelCA, limit: int = 256) -> None:
        self.ca = ca
        self.limit = limit
        self._contexts: OrderedDict[str, tuple[ssl.SSLContext, datetime.datetime]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, host: str) -> ssl.SSLContext:
        """The context for ``host``; thread-safe (a new one costs a key and a signature,
        tens of milliseconds: call it off an event loop)."""
        with self._lock:
            return self._get(normalize_host(host))

    def _get(self, host: str) -> ssl.SSLContext:
        found = self._contexts.get(host)
        if found is not None and found[1] - _now() > LEAF_RENEWAL:
            self._contexts.move_to_end(host)
            return found[0]
        chain, key = self.ca.leaf(host)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.options |= ssl.OP_NO_RENEGOTIATION
        context.set_alpn_protocols(["http/1.1"])
        # load_cert_chain reads files only: a private folder, gone at once.
        with tempfile.TemporaryDirectory(prefix="sk-egress-leaf-") as folder:
            cert_file, key_file = Path(folder) / "cert.pem", Path(folder) / "key.pem"
            cert_file.write_bytes(chain)
            key_file.touch(mode=0o600)
            key_file.write_bytes(key)
            context.load_cert_chain(cert_file, key_file)
        expires = x509.load_pem_x509_certificate(chain).not_valid_after_utc
        self._contexts[host] = (context, expires)
        self._contexts.move_to_end(host)
        while len(self._contexts) > self.limit:
            self._contexts.popitem(last=False)
        return context
