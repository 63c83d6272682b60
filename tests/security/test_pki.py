"""The federation CA: what it issues, what it refuses, and what check_certificate says."""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedagent.errors import ClockBehind, ConfigError
from fedagent.security import pki as pk


def load(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def ca_dir(tmp_path):
    pk.create_ca(tmp_path / "ca", "fed-1")
    return tmp_path / "ca"


def test_create_ca_writes_a_p256_ca_with_a_private_key(tmp_path):
    cert_path = pk.create_ca(tmp_path / "ca", "fed-1", days=30)
    assert cert_path == tmp_path / "ca" / "ca.crt"
    assert mode(tmp_path / "ca" / "ca.key") == 0o600
    cert = load(cert_path)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.public_key().curve.name == "secp256r1"
    assert cert.issuer == cert.subject
    assert pk.ca_federation(cert_path) == "fed-1"
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=30) <= lifetime <= dt.timedelta(days=30, minutes=10)


def test_create_ca_refuses_to_overwrite(ca_dir):
    before = (ca_dir / "ca.crt").read_bytes()
    with pytest.raises(ConfigError, match="already exists"):
        pk.create_ca(ca_dir, "fed-1")
    assert (ca_dir / "ca.crt").read_bytes() == before


def test_create_ca_refuses_a_bad_federation_name(tmp_path):
    with pytest.raises(ConfigError):
        pk.create_ca(tmp_path / "ca", "Fed/#")
    assert not (tmp_path / "ca").exists()


def test_agent_certificate_round_trip(ca_dir, tmp_path):
    crt, key = pk.issue(ca_dir, tmp_path / "out", "agent-a", "agent")
    assert (crt, key) == (tmp_path / "out" / "agent-a.crt", tmp_path / "out" / "agent-a.key")
    assert mode(key) == 0o600
    assert pk.common_name(crt) == "agent-a"
    assert pk.role_of(crt) == "agent"
    cert = load(crt)
    assert cert.issuer == load(ca_dir / "ca.crt").subject
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "agent"
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(load(ca_dir / "ca.crt"))
    der = cert.public_bytes(serialization.Encoding.DER)
    assert pk.fingerprint(crt) == hashlib.sha256(der).hexdigest()
    pk.check_certificate(crt, key, ca_dir / "ca.crt")


def test_coordinator_gets_client_auth_and_its_role(ca_dir, tmp_path):
    crt, _ = pk.issue(ca_dir, tmp_path, "coord", "coordinator")
    assert pk.role_of(crt) == "coordinator"
    eku = load(crt).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_broker_certificate_has_server_auth_and_default_sans(ca_dir, tmp_path):
    crt, _ = pk.issue(ca_dir, tmp_path, "broker", "broker")
    cert = load(crt)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]


def test_broker_sans_are_ip_addresses_when_they_parse_as_one(ca_dir, tmp_path):
    crt, _ = pk.issue(
        ca_dir, tmp_path, "broker", "broker", sans=["10.77.0.1", "::1", "broker.local"], default_sans=False
    )
    san = load(crt).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.77.0.1"), ipaddress.ip_address("::1")]
    assert san.get_values_for_type(x509.DNSName) == ["broker.local"]


def test_broker_sans_add_to_localhost_and_127_0_0_1(ca_dir, tmp_path):
    crt, _ = pk.issue(ca_dir, tmp_path, "broker", "broker", sans=["10.77.0.1", "hub.lan", "127.0.0.1"])
    san = load(crt).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = [ipaddress.ip_address(a) for a in ("127.0.0.1", "10.77.0.1")]
    assert san.get_values_for_type(x509.IPAddress) == ips  # no duplicate
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "hub.lan"]


def test_cli_san_adds_to_the_defaults(ca_dir, tmp_path):
    from click.testing import CliRunner

    from fedagent.cli import main

    args = ["ca", "issue", "hub", "--role", "broker", "--dir", str(ca_dir), "--out", str(tmp_path)]
    result = CliRunner().invoke(main, [*args, "--san", "10.77.0.1", "--san", "hub.lan"])
    assert result.exit_code == 0, result.output
    san = load(tmp_path / "hub.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(map(str, san.get_values_for_type(x509.IPAddress))) == {"127.0.0.1", "10.77.0.1"}
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "hub.lan"}


def test_member_certificates_name_their_federation_and_are_registered(ca_dir, tmp_path):
    crt, _ = pk.issue(ca_dir, tmp_path, "agent-a", "agent")
    san = load(crt).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["fedagent://fed-1/agent/agent-a"]
    assert pk.federation_of(crt) == "fed-1"
    other, _ = pk.issue(ca_dir, tmp_path, "coord-2", "coordinator", federation="fed-2")
    assert pk.federation_of(other) == "fed-2"
    assert pk.members(ca_dir) == {"agent-a": ("agent", "fed-1"), "coord-2": ("coordinator", "fed-2")}
    # Re-issuing in the same federation renews; the name is its client id on the broker,
    # so it cannot belong to a second federation of the same CA.
    pk.issue(ca_dir, tmp_path, "agent-a", "agent")
    with pytest.raises(ConfigError, match="already a member of federation fed-1"):
        pk.issue(ca_dir, tmp_path, "agent-a", "agent", federation="fed-2")
    broker, _ = pk.issue(ca_dir, tmp_path, "broker", "broker")
    assert pk.federation_in(load(broker)) is None and "broker" not in pk.members(ca_dir)


def test_cli_issue_takes_the_federation_from_the_ca_or_an_option(ca_dir, tmp_path):
    from click.testing import CliRunner

    from fedagent.cli import main

    base = ["ca", "issue", "--role", "agent", "--dir", str(ca_dir), "--out", str(tmp_path)]
    assert CliRunner().invoke(main, [*base, "a1"]).exit_code == 0
    assert CliRunner().invoke(main, [*base, "b1", "--federation", "fed-b"]).exit_code == 0
    assert pk.federation_of(tmp_path / "a1.crt") == "fed-1"
    assert pk.federation_of(tmp_path / "b1.crt") == "fed-b"
    refused = CliRunner().invoke(main, [*base, "b1"])
    assert refused.exit_code != 0 and "already a member of federation fed-b" in refused.output


def test_each_certificate_is_distinct(ca_dir, tmp_path):
    a, _ = pk.issue(ca_dir, tmp_path / "1", "agent-a", "agent")
    b, _ = pk.issue(ca_dir, tmp_path / "2", "agent-a", "agent")
    assert pk.fingerprint(a) != pk.fingerprint(b)
    assert len(pk.fingerprint(a)) == 64


@pytest.mark.parametrize("name", ["agent/#", "a+b", "A", "", "x" * 64, "-lead", "a b", "a#"])
def test_invalid_names_are_refused_before_anything_is_signed(ca_dir, tmp_path, name):
    with pytest.raises(ConfigError, match="invalid node id"):
        pk.issue(ca_dir, tmp_path / "out", name, "agent")
    assert not (tmp_path / "out").exists()


def test_longest_valid_name_is_accepted(ca_dir, tmp_path):
    crt, _ = pk.issue(ca_dir, tmp_path, "x" * 63, "agent")
    assert pk.common_name(crt) == "x" * 63


def test_unknown_role_is_refused(ca_dir, tmp_path):
    with pytest.raises(ConfigError, match="unknown role 'admin'"):
        pk.issue(ca_dir, tmp_path, "agent-a", "admin")


def test_issue_without_a_ca_says_so(tmp_path):
    with pytest.raises(ConfigError, match="create the federation CA first"):
        pk.issue(tmp_path / "nothing", tmp_path, "agent-a", "agent")


def test_expired_certificate_is_detected_with_an_actionable_message(ca_dir, tmp_path):
    now = dt.datetime.now(dt.UTC)
    expired = now - dt.timedelta(days=1)
    crt, key = pk.issue(ca_dir, tmp_path, "agent-b", "agent", not_before=now - dt.timedelta(days=10), not_after=expired)
    with pytest.raises(ConfigError) as err:
        pk.check_certificate(crt, key, ca_dir / "ca.crt")
    assert str(err.value) == (
        f"certificate for agent-b expired on {expired:%Y-%m-%d}; issue a new one with "
        "`fedagent ca issue agent-b --role agent`"
    )


def test_the_expired_fixture_certificate(pki):
    tls = pki.tls("agent-old")
    with pytest.raises(
        ConfigError,
        match=r"certificate for agent-old expired on \d{4}-\d\d-\d\d; "
        r"issue a new one with `fedagent ca issue agent-old --role agent`",
    ):
        pki_check(tls)


def pki_check(tls):
    pk.check_certificate(tls.cert, tls.key, tls.ca)


def test_not_yet_valid_certificate_is_detected(ca_dir, tmp_path):
    now = dt.datetime.now(dt.UTC)
    crt, key = pk.issue(
        ca_dir,
        tmp_path,
        "agent-c",
        "agent",
        not_before=now + dt.timedelta(days=2),
        not_after=now + dt.timedelta(days=9),
    )
    with pytest.raises(ClockBehind, match="not valid before .* is the clock set"):
        pk.check_certificate(crt, key, ca_dir / "ca.crt")


def test_validity_window_must_not_be_empty(ca_dir, tmp_path):
    now = dt.datetime.now(dt.UTC)
    with pytest.raises(ConfigError, match="would expire"):
        pk.issue(ca_dir, tmp_path, "agent-c", "agent", not_before=now, not_after=now)


def test_certificate_from_another_ca_is_detected(pki):
    foreign = pki.tls("agent-a", foreign=True)
    with pytest.raises(ConfigError, match="was not issued by this federation's CA"):
        pki_check(foreign)


def test_key_that_does_not_match_is_detected(pki):
    a, b = pki.tls("agent-a"), pki.tls("agent-b")
    with pytest.raises(ConfigError, match="does not match certificate"):
        pk.check_certificate(a.cert, b.key, a.ca)


@pytest.mark.parametrize("missing", ["cert", "key", "ca"])
def test_missing_files_are_named(pki, tmp_path, missing):
    tls = pki.tls("agent-a")
    paths = {"cert": tls.cert, "key": tls.key, "ca": tls.ca}
    paths[missing] = tmp_path / f"absent.{missing}"
    with pytest.raises(ConfigError, match=f"absent.{missing}"):
        pk.check_certificate(paths["cert"], paths["key"], paths["ca"])


def test_fixture_identities(pki):
    for name, role in [("agent-a", "agent"), ("agent-b", "agent"), ("coord", "coordinator")]:
        tls = pki.tls(name)
        assert pk.common_name(tls.cert) == name
        assert pk.role_of(tls.cert) == role
        pki_check(tls)
    assert pk.common_name(pki.tls("agent-a", foreign=True).cert) == "agent-a"


def test_join_refuses_a_federation_the_certificate_is_not_for(ca_dir, tmp_path):
    from click.testing import CliRunner

    from fedagent import config
    from fedagent.cli import main

    cert, key = pk.issue(ca_dir, tmp_path, "agent-a", "agent")
    cfg = tmp_path / "agent.toml"
    tls = config.TlsConfig(ca_dir / pk.CA_CERT, cert, key)
    cfg.write_text(config.render(node_id="agent-a", federation="", tls=tls, state_dir=tmp_path / "state"))
    result = CliRunner().invoke(main, ["join", "fed-2", "--broker", "mqtts://127.0.0.1:1", "--config", str(cfg)])
    assert result.exit_code != 0
    assert "makes agent-a a member of federation fed-1, not fed-2" in result.output
    assert "--federation fed-2" in result.output
    assert config.load(cfg, "agent").federation == ""  # nothing recorded
