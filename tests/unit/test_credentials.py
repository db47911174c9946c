"""Credentials the egress proxy adds: how they are configured, read on the host, and
when they stop applying. Their values never show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sandbox_kernel.egress.credentials import (
    BoundCredential,
    CredentialTable,
    Secret,
    parse_definitions,
    resolve,
)
from sandbox_kernel.errors import ConfigurationError

TOKEN = "s3cr3t-t0k3n"


def warehouse(**changes: Any) -> dict[str, Any]:
    definition = {
        "domains": ["api.example.com"],
        "headers": {"Authorization": "Bearer {env:WAREHOUSE_TOKEN}"},
    }
    return {"warehouse": {**definition, **changes}}


def test_a_definition_names_domains_headers_and_a_lifetime() -> None:
    spec = parse_definitions(warehouse(ttl=3600))["warehouse"]
    assert spec.rules.patterns == ("api.example.com",)
    assert spec.header_names == ("Authorization",)
    assert spec.ttl == 3600


@pytest.mark.parametrize(
    ("definition", "says"),
    [
        ({"warehouse": {"headers": {"X-Key": "k"}}}, "names no domains"),
        (warehouse(domains=["https://api.example.com/v1"]), "schemes and paths are not accepted"),
        (warehouse(headers={}), "adds no headers"),
        (warehouse(headers={"Bad Name": "x"}), "not a header name"),
        (warehouse(headers={"Host": "x"}), "belongs to the connection"),
        (warehouse(headers={"Proxy-Authorization": "x"}), "belongs to the connection"),
        (warehouse(headers={"Authorization": 42}), "not a string"),
        (warehouse(headers={"Authorization": "Bearer {TOKEN}"}), "lone"),
        (warehouse(headers={"Authorization": "{env:1BAD}"}), "not an environment variable"),
        (warehouse(headers={"Authorization": "{file:token.txt}"}), "absolute path"),
        (warehouse(ttl=-1), "ttl"),
        (warehouse(scope="all"), "unknown keys"),
        ({"bad name": {}}, "not a credential name"),
        (["warehouse"], "must map credential names"),
    ],
)
def test_a_broken_definition_says_what_is_wrong(definition: Any, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says) as error:
        parse_definitions(definition)
    assert "SandboxProvisioner.credentials" in str(error.value)


def test_two_credentials_may_not_set_one_header_for_the_same_domains() -> None:
    with pytest.raises(ConfigurationError, match="'warehouse' and 'other' both set 'authorization'"):
        parse_definitions(
            {
                **warehouse(),
                "other": {"domains": ["*.example.com"], "headers": {"authorization": "Basic x"}},
            }
        )
    both = {**warehouse(), "other": {"domains": ["*.example.com"], "headers": {"X-Api-Key": "x"}}}
    assert set(parse_definitions(both)) == {"warehouse", "other"}


def test_values_are_read_on_the_host_and_never_shown(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    assert resolve("Bearer {env:T}", "w", {"T": TOKEN}).reveal() == f"Bearer {TOKEN}"
    assert resolve("{file:" + str(token_file) + "}", "w", {}).reveal() == TOKEN
    assert resolve("{{literal}}", "w", {}).reveal() == "{literal}"
    spec = parse_definitions(warehouse(ttl=60))["warehouse"]
    bound = BoundCredential.bind(spec, environ={"WAREHOUSE_TOKEN": TOKEN})
    assert bound.headers == (("Authorization", Secret(f"Bearer {TOKEN}")),)
    assert TOKEN not in repr(bound) + str(bound.headers) + repr(spec)
    literal = parse_definitions(warehouse(headers={"X-Key": TOKEN}))["warehouse"]
    assert TOKEN not in repr(literal), "a value written into the config is not shown either"
    assert bound.expires_at is not None


@pytest.mark.parametrize(
    ("template", "environ", "says"),
    [
        ("{env:MISSING}", {}, "environment variable MISSING, not set"),
        ("{file:/nonexistent/token}", {}, "could not read /nonexistent/token"),
        ("{env:T}", {"T": "a\r\nX-Injected: 1"}, "line break"),
        ("{env:T}", {"T": "Bearer 10€"}, "non-ASCII"),
    ],
)
def test_a_value_that_cannot_be_read_fails_naming_the_placeholder(
    template: str, environ: dict[str, str], says: str
) -> None:
    with pytest.raises(ConfigurationError, match=says) as error:
        resolve(template, "warehouse", environ)
    assert "a\r\n" not in str(error.value)


def bound(
    name: str = "warehouse", expires_at: float | None = None, domains: str = "api.example.com"
) -> BoundCredential:
    spec = parse_definitions(warehouse(domains=[domains]))["warehouse"]
    credential = BoundCredential.bind(spec, expires_at=expires_at, environ={"WAREHOUSE_TOKEN": TOKEN})
    return BoundCredential(name, credential.rules, credential.headers, credential.expires_at)


def test_a_table_intercepts_only_hosts_with_a_credential() -> None:
    table = CredentialTable([bound()])
    assert table.intercepts("api.example.com", 443)
    assert table.intercepts("API.example.com.", 443)
    assert not table.intercepts("other.example.com", 443)
    assert not table.intercepts("api.example.com", 8443)
    live, ended = table.lookup("api.example.com", 443)
    assert [c.name for c in live] == ["warehouse"]
    assert ended == []


def test_an_expired_or_revoked_credential_says_so_and_is_not_added() -> None:
    table = CredentialTable([bound(expires_at=1000.0), bound("adhoc", domains="db.example.com")])
    live, ended = table.lookup("api.example.com", 443, now=999.0)
    assert [c.name for c in live] == ["warehouse"]
    live, ended = table.lookup("api.example.com", 443, now=1000.0)
    assert live == []
    assert ended == ["credential 'warehouse' expired at 1970-01-01T00:16:40Z"]
    assert table.intercepts("api.example.com", 443), "a request still learns why"
    assert table.revoke("adhoc", now=0)
    assert not table.revoke("adhoc")
    assert table.lookup("db.example.com", 443) == (
        [],
        ["credential 'adhoc' was revoked at 1970-01-01T00:00:00Z"],
    )
    table.bind(bound("adhoc", domains="db.example.com"))
    assert [c.name for c in table.lookup("db.example.com", 443)[0]] == ["adhoc"], "bound again, it applies"


def test_binding_a_credential_that_clashes_with_a_bound_one_is_refused() -> None:
    table = CredentialTable([bound()])
    with pytest.raises(ConfigurationError, match="bind_credential"):
        table.bind(bound("second", domains="*.example.com"))
    assert table.names == ("warehouse",)
