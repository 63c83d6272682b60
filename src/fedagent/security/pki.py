"""The federation's certificate authority and the certificates it issues.

A CA is created for a federation and issues its members' certificates; it may also
issue for further federations that share its broker (``issue(..., federation=...)``).
Every agent or coordinator certificate names its federation in a SAN URI
``fedagent://<federation>/<role>/<name>``: receivers refuse messages signed by a
member of another federation (:mod:`fedagent.security.signing`), and the broker ACL is written
from the CA's register of what it issued (``issued.jsonl``, :func:`members`), so a
certificate may act only in its own federation's topics. The certificate's CN is the
node id and becomes the MQTT username (``use_identity_as_username``) and client id
(``use_username_as_clientid``), which the broker ACL substitutes for ``%u``; a name
therefore belongs to one federation per CA.
That is why a name is validated with :func:`fedagent.protocols.topics.check_name`
before anything is signed: a CN containing ``#``, ``+`` or ``/`` would let its holder
escape its ACL subtree (Mosquitto CVE-2017-7650).

The CA and broker keys are ECDSA P-256 (fast handshakes on small devices, supported by
every OpenSSL Mosquitto links against). Agent and coordinator keys are Ed25519: the same
key authenticates the node to the broker (TLS) and signs every message it sends
(:mod:`fedagent.security.signing`), so the certificate that binds the key to the node id is the
one the CA issued for TLS and no second key or certificate has to be managed. Keys are
written with mode 0600. Everything is done with
``cryptography``; no ``openssl`` command is needed.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import ipaddress
import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedagent.errors import ClockBehind, ConfigError
from fedagent.protocols.topics import check_name
from fedagent.storage.statefile import atomic_write

# An aggregator is a site aggregator at its upstream tier (docs/multisite.md): it takes
# part in rounds as an agent does, and the upstream coordinator weighs it as a site.
ROLES = ("agent", "coordinator", "broker", "aggregator")
DEFAULT_BROKER_SANS = ("localhost", "127.0.0.1")
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
REGISTER = "issued.jsonl"
URI_SCHEME = "fedagent"
_ORG = "fedagent"
# Certificates start a little in the past so a peer whose clock runs a few minutes
# behind does not reject a certificate issued a second ago.
_BACKDATE = _dt.timedelta(minutes=5)


def _now() -> datetime:
    return datetime.now(_dt.UTC)


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically with mode 0600 from the first byte."""
    atomic_write(path, data, mode=0o600)


def _write_public(path: Path, data: bytes) -> None:
    atomic_write(path, data, mode=0o644)


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_cert(path: Path) -> x509.Certificate:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"certificate file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read certificate {path}: {exc.strerror}") from exc
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise ConfigError(f"{path} is not a PEM certificate: {exc}") from exc


def _load_key(path: Path):
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"private key file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read private key {path}: {exc.strerror}") from exc
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not an unencrypted PEM private key: {exc}") from exc


def _attr(cert: x509.Certificate, oid) -> str:
    values = cert.subject.get_attributes_for_oid(oid)
    return str(values[0].value) if values else ""


def _pubkey_bytes(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


# --- the CA ------------------------------------------------------------------------


def create_ca(directory: Path, federation: str, *, days: int = 3650) -> Path:
    """Create ``ca.crt`` and ``ca.key`` (0600) for ``federation`` in ``directory``.

    Refuses to overwrite an existing CA: every certificate it signed would stop
    working. Returns the path of ``ca.crt``.
    """
    check_name(federation, "federation")
    if days <= 0:
        raise ConfigError(f"CA validity must be at least one day, not {days}")
    directory = Path(directory)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    for p in (cert_path, key_path):
        if p.exists():
            raise ConfigError(
                f"a CA already exists at {p}; refusing to overwrite it "
                "(every certificate it issued would become invalid)"
            )
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, f"federation {federation}"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"fedagent CA {federation}"),
        ]
    )
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + _dt.timedelta(days=days))
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
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(key_path, _key_pem(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path


def ca_federation(ca_path: Path) -> str:
    """The federation a CA created by :func:`create_ca` belongs to."""
    return _ca_federation(_load_cert(ca_path))


def _ca_federation(ca: x509.Certificate) -> str:
    return _attr(ca, NameOID.ORGANIZATIONAL_UNIT_NAME).removeprefix("federation ")


def member_uri(federation: str, role: str, name: str) -> str:
    """The SAN URI that binds a member certificate to its federation."""
    return f"{URI_SCHEME}://{check_name(federation, 'federation')}/{role}/{check_name(name, 'node id')}"


def federation_in(cert: x509.Certificate) -> str | None:
    """The federation named in ``cert``'s ``fedagent://`` SAN URI; None if it has none
    (a certificate issued before federations were bound into certificates)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        scheme, sep, rest = uri.partition("://")
        if scheme == URI_SCHEME and sep:
            return rest.split("/", 1)[0]
    return None


def federation_of(cert_path: Path, ca_path: Path | None = None) -> str:
    """The federation of a member certificate; one without a ``fedagent://`` URI
    belongs to its CA's own federation (``ca_path``), or "" when that is not given."""
    fed = federation_in(_load_cert(cert_path))
    if fed is not None:
        return fed
    return ca_federation(ca_path) if ca_path is not None else ""


def check_member_of(cert_path: Path, ca_path: Path, federation: str) -> None:
    """ConfigError unless the certificate is a member certificate of ``federation``."""
    fed = federation_of(cert_path, ca_path)
    if fed != federation:
        name = common_name(cert_path) or Path(cert_path).stem
        raise ConfigError(
            f"certificate {cert_path} makes {name} a member of federation {fed}, not {federation}: the "
            f"broker and the other members would refuse it there; get one for {federation} "
            f"(`fedagent ca issue {name} --role {role_of(cert_path) or 'agent'} --federation {federation}` "
            "with the CA that serves it)"
        )


def members(ca_dir: Path) -> dict[str, tuple[str, str]]:
    """``{name: (role, federation)}`` of every agent and coordinator certificate the CA
    in ``ca_dir`` issued (its register; the newest entry of a name wins). Empty for a CA
    without a register."""
    path = Path(ca_dir) / REGISTER
    out: dict[str, tuple[str, str]] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    except OSError as exc:
        raise ConfigError(f"cannot read the CA register {path}: {exc.strerror}") from exc
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            name, role, fed = rec["name"], rec["role"], rec["federation"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path} line {n} is not a register entry") from None
        check_name(name, "node id")
        check_name(fed, "federation")
        if role not in ROLES:
            raise ConfigError(f"{path} line {n}: unknown role {role!r}")
        out[name] = (role, fed)
    return out


def _register(ca_dir: Path, name: str, role: str, federation: str, cert: x509.Certificate) -> None:
    rec = {
        "name": name,
        "role": role,
        "federation": federation,
        "serial": format(cert.serial_number, "x"),
        "not_after": cert.not_valid_after_utc.isoformat(),
    }
    fd = os.open(Path(ca_dir) / REGISTER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with os.fdopen(fd, "a") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


# --- leaf certificates -------------------------------------------------------------


def _san_entries(sans: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for entry in sans:
        entry = entry.strip()
        if not entry:
            raise ConfigError("empty subject alternative name")
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(entry)))
        except ValueError:
            out.append(x509.DNSName(entry))
    return out


def issue(
    ca_dir: Path,
    out_dir: Path,
    name: str,
    role: str,
    *,
    sans: Sequence[str] = (),
    default_sans: bool = True,
    federation: str | None = None,
    days: int = 825,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
) -> tuple[Path, Path]:
    """Issue ``<out_dir>/<name>.crt`` and ``<name>.key`` (0600), signed by the CA in
    ``ca_dir``; returns ``(cert_path, key_path)``.

    ``role`` is one of :data:`ROLES` and is recorded as the subject's OU. Agents and
    coordinators get clientAuth and a SAN URI naming their ``federation`` (default:
    the CA's own), and are recorded in the CA's register (:func:`members`); a name
    already registered for another federation is refused, since the name is the
    node's client id on the broker. A broker gets serverAuth and clientAuth and SANs:
    ``localhost`` and ``127.0.0.1`` plus ``sans`` (each an IP address if it parses as
    one, else a DNS name), or only ``sans`` with ``default_sans=False``.
    ``not_before``/``not_after`` override the validity window (tests use them to make
    an expired certificate). An existing certificate of the same name is replaced
    (re-issuing is how an expired one is renewed).
    """
    check_name(name, "node id")
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    ca_dir, out_dir = Path(ca_dir), Path(out_dir)
    if not (ca_dir / CA_KEY).exists():
        raise ConfigError(f"no CA key at {ca_dir / CA_KEY}; create the federation CA first with `fedagent ca init`")
    ca_cert = _load_cert(ca_dir / CA_CERT)
    ca_key = _load_key(ca_dir / CA_KEY)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{ca_dir / CA_KEY} is not an ECDSA key")
    if _pubkey_bytes(ca_key.public_key()) != _pubkey_bytes(ca_cert.public_key()):
        raise ConfigError(f"{ca_dir / CA_KEY} does not belong to {ca_dir / CA_CERT}")

    now = _now()
    start = not_before if not_before is not None else now - _BACKDATE
    end = not_after if not_after is not None else now + _dt.timedelta(days=days)
    if end <= start:
        raise ConfigError(
            f"certificate for {name} would expire ({end:%Y-%m-%d %H:%M}) "
            f"before it becomes valid ({start:%Y-%m-%d %H:%M})"
        )
    fed = ""
    if role == "broker":
        listed = [*(DEFAULT_BROKER_SANS if default_sans or not sans else ()), *(x.strip() for x in sans)]
        sans = list(dict.fromkeys(listed))
    else:
        fed = check_name(federation or _ca_federation(ca_cert), "federation")
        earlier = members(ca_dir).get(name)
        if earlier is not None and earlier[1] != fed:
            raise ConfigError(
                f"{name} is already a member of federation {earlier[1]} in this CA ({ca_dir / REGISTER}); "
                "a node id is its client id on the broker, so pick another name for federation "
                f"{fed}"
            )

    # Nodes that send messages sign them with their TLS key, so theirs is Ed25519.
    key = ec.generate_private_key(ec.SECP256R1()) if role == "broker" else ed25519.Ed25519PrivateKey.generate()
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    eku = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role == "broker":
        eku = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
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
        .add_extension(x509.ExtendedKeyUsage(eku), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    alt = _san_entries(sans) if sans else []
    if fed:
        alt.append(x509.UniformResourceIdentifier(member_uri(fed, role, name)))
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())

    out_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out_dir / f"{name}.crt", out_dir / f"{name}.key"
    _write_private(key_path, _key_pem(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    if fed:
        _register(ca_dir, name, role, fed, cert)
    return cert_path, key_path


# --- reading certificates ----------------------------------------------------------


def fingerprint(cert_path: Path) -> str:
    """SHA-256 of the certificate's DER encoding, lower-case hex."""
    der = _load_cert(cert_path).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def common_name(cert_path: Path) -> str:
    return _attr(_load_cert(cert_path), NameOID.COMMON_NAME)


def role_of(cert_path: Path) -> str:
    return _attr(_load_cert(cert_path), NameOID.ORGANIZATIONAL_UNIT_NAME)


def not_after(cert_path: Path) -> datetime:
    return _load_cert(cert_path).not_valid_after_utc


def _reissue_hint(name: str, role: str) -> str:
    role = role if role in ROLES else "agent"
    return f"issue a new one with `fedagent ca issue {name} --role {role}`"


def check_certificate(cert_path: Path, key_path: Path, ca_path: Path) -> None:
    """Check that ``cert_path`` is usable with ``key_path`` in the federation of
    ``ca_path``: files present, signed by that CA, currently valid, key matching.

    Raises ConfigError saying what is wrong and what to do about it.
    """
    cert_path, key_path, ca_path = Path(cert_path), Path(key_path), Path(ca_path)
    stem = cert_path.stem
    if not ca_path.exists():
        raise ConfigError(f"the federation CA certificate {ca_path} is missing; copy the federation's ca.crt there")
    if not cert_path.exists():
        raise ConfigError(f"no client certificate: {cert_path} is missing; {_reissue_hint(stem, 'agent')}")
    if not key_path.exists():
        raise ConfigError(f"the private key {key_path} for {cert_path.name} is missing; {_reissue_hint(stem, 'agent')}")
    ca = _load_cert(ca_path)
    cert = _load_cert(cert_path)
    key = _load_key(key_path)
    name = _attr(cert, NameOID.COMMON_NAME) or stem
    role = _attr(cert, NameOID.ORGANIZATIONAL_UNIT_NAME)
    hint = _reissue_hint(name, role)

    now = _now()
    if now > ca.not_valid_after_utc:
        raise ConfigError(
            f"the federation CA {ca_path} expired on {ca.not_valid_after_utc:%Y-%m-%d}; the federation needs a new CA"
        )
    try:
        if cert.issuer != ca.subject:
            raise ValueError("issuer name differs")
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError(
            f"certificate {cert_path} for {name} was not issued by this federation's CA "
            f"({ca_path}, {_attr(ca, NameOID.COMMON_NAME)}); it was issued by "
            f"{cert.issuer.rfc4514_string()}. {hint[0].upper()}{hint[1:]} using this CA"
        ) from None
    if now > cert.not_valid_after_utc:
        raise ConfigError(f"certificate for {name} expired on {cert.not_valid_after_utc:%Y-%m-%d}; {hint}")
    if now < cert.not_valid_before_utc:
        raise ClockBehind(
            f"certificate for {name} is not valid before "
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC and this machine's clock says "
            f"{now:%Y-%m-%d %H:%M} UTC: is the clock set (timedatectl)? Otherwise {hint}"
        )
    if _pubkey_bytes(key.public_key()) != _pubkey_bytes(cert.public_key()):
        raise ConfigError(f"private key {key_path} does not match certificate {cert_path}; {hint}")
