"""Throwaway certificate authorities and SSL contexts for mutual-TLS tests on loopback."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    """SSL contexts for mutual-TLS tests: a fleet CA's server and client, and two misfits."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    stranger: ssl.SSLContext  # a client whose certificate another CA signed
    naive: ssl.SSLContext  # a client that trusts another CA, so not our server


def make_pki(tmp: Path) -> Pki:
    """Write two throwaway CAs ("fleet", "other") with a server and a client leaf each (EC P-256,
    valid for a day, SAN 127.0.0.1/localhost) under ``tmp``, and return contexts that use them."""
    now = datetime.datetime.now(datetime.UTC)

    def cert(cn, key, issuer_cn, issuer_key, *, ca, usage=None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
            )
        )
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                True,
            )
        else:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), False)
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    def write(name, key, crt):
        pem = crt.public_bytes(serialization.Encoding.PEM)
        (tmp / f"{name}.crt").write_bytes(pem)
        (tmp / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return str(tmp / f"{name}.crt"), str(tmp / f"{name}.key")

    paths = {}
    for ca_name in ("fleet", "other"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        paths[ca_name] = write(ca_name, ca_key, cert(ca_name, ca_key, ca_name, ca_key, ca=True))
        for leaf, usage in (
            ("server", ExtendedKeyUsageOID.SERVER_AUTH),
            ("client", ExtendedKeyUsageOID.CLIENT_AUTH),
        ):
            key = ec.generate_private_key(ec.SECP256R1())
            crt = cert(f"{ca_name}-{leaf}", key, ca_name, ca_key, ca=False, usage=usage)
            paths[f"{ca_name}-{leaf}"] = write(f"{ca_name}-{leaf}", key, crt)

    def context(purpose, ca, leaf):
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(paths[ca][0])
        ctx.load_cert_chain(*paths[leaf])
        if purpose == ssl.PROTOCOL_TLS_SERVER:
            ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS
        return ctx

    return Pki(
        server=context(ssl.PROTOCOL_TLS_SERVER, "fleet", "fleet-server"),
        client=context(ssl.PROTOCOL_TLS_CLIENT, "fleet", "fleet-client"),
        stranger=context(ssl.PROTOCOL_TLS_CLIENT, "fleet", "other-client"),
        naive=context(ssl.PROTOCOL_TLS_CLIENT, "other", "other-client"),
    )
