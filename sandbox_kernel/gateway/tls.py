"""The gateway's TLS: a certificate authority of its own and the server certificate it signs.

``jupyter sandbox-kernel gateway init-tls`` writes them; the users' servers trust the CA
(``JUPYTER_GATEWAY_CA_CERTS``), the gateway serves with the certificate. Unlike the
egress proxy's per-kernel CAs (:mod:`sandbox_kernel.egress.ca`), this one signs for IP
addresses as well as names (a sandbox host is often reached by its address) and is not
name-constrained: it signs the gateway's certificates only, and its key stays with root.

Crypto (``cryptography``), and :func:`write_tls_files` writing it.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sandbox_kernel.host.files import replace_file

#: Clocks disagree a little; certificates start this much before they are made.
BACKDATE = datetime.timedelta(hours=1)
CA_LIFETIME = datetime.timedelta(days=10 * 365)
SERVER_LIFETIME = datetime.timedelta(days=2 * 365)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _usage(*, signs: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not signs,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs,
        crl_sign=signs,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(common_name: str = "sandbox-kernel gateway CA") -> tuple[bytes, bytes]:
    """A new CA: (certificate PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + CA_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(signs=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_server_cert(
    ca_cert_pem: bytes, ca_key_pem: bytes, hostnames: Iterable[str], ips: Iterable[str]
) -> tuple[bytes, bytes]:
    """A server certificate for ``hostnames`` and ``ips``, signed by the CA: (certificate
    chain PEM, key PEM).

    Raises:
        ValueError: no name or address is given, an address is not one, or the key is
            not the CA's kind.
    """
    names: list[x509.GeneralName] = [x509.DNSName(h) for h in hostnames]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    if not names:
        msg = "a server certificate needs at least one host name or IP address"
        raise ValueError(msg)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        msg = "the gateway CA's key is not an EC key"
        raise ValueError(msg)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    first = names[0].value
    ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(first))]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(now + SERVER_LIFETIME, ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(signs=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM) + ca_cert_pem, _key_pem(key)


def write_tls_files(folder: Path, hostnames: Iterable[str], ips: Iterable[str]) -> bool:
    """Write the gateway's TLS files in ``folder``: a CA (``ca.pem``, its key ``ca-key.pem``)
    unless the folder has one, and a server certificate it signs for ``hostnames`` and
    ``ips`` (``server.pem``, ``server-key.pem``). A folder made here is 0755 and the
    certificates 0644, so every user's server may read ``ca.pem`` where it is; the keys are
    0600. Whether a new CA was made.

    Raises:
        ValueError: as :func:`make_server_cert`.
    """
    if not folder.is_dir():
        folder.mkdir(parents=True)
        folder.chmod(0o755)  # whatever the umask: the certificates are for everyone to read
    ca, ca_key = folder / "ca.pem", folder / "ca-key.pem"
    made = not (ca.exists() and ca_key.exists())
    if made:
        cert_pem, key_pem = make_ca()
    else:
        cert_pem, key_pem = ca.read_bytes(), ca_key.read_bytes()
    chain, key = make_server_cert(cert_pem, key_pem, hostnames, ips)
    if made:
        replace_file(ca_key, key_pem, 0o600)
        replace_file(ca, cert_pem, 0o644)
    replace_file(folder / "server-key.pem", key, 0o600)
    replace_file(folder / "server.pem", chain, 0o644)
    return made
