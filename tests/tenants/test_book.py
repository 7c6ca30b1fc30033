"""The tenants file: parsed strictly, reloaded when it changes, a bad reload keeping the old."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trio_pdrouter.tenants import (
    DEFAULT,
    Tenancy,
    Tenant,
    TenantsFile,
    TenantsFileError,
    parse_book,
)

GOOD = """
[tenants.alice]
keys = ["sk-alice-1", "sk-alice-2"]
weight = 2
max_concurrent_requests = 8
tokens_per_second = 5000

[tenants.bob]
keys = ["sk-bob"]

[tenants.default]
max_concurrent_requests = 4
"""


def test_a_good_file_names_each_keys_tenant_with_its_weight_and_limits() -> None:
    book = parse_book(GOOD)
    assert book.by_key(b"sk-alice-2") == Tenant("alice", 2.0, 8, 5000)
    assert book.by_key(b"sk-bob") == Tenant("bob")
    assert book.by_key(b"sk-nobody") is None
    assert book.default == Tenant(DEFAULT, 1.0, 4, None)
    assert book.named("bob").name == "bob" and book.named("carol").name == DEFAULT
    assert book.names() == ["alice", "bob", "default"]


def test_without_a_default_table_the_default_tenant_has_weight_1_and_no_limits() -> None:
    assert parse_book("[tenants.a]\nkeys = ['k']\n").default == Tenant()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[tenants.a\n", "not valid TOML"),
        ("[tenantz.a]\n", "unknown top-level key 'tenantz'"),
        ("[tenants.a]\nwieght = 2\n", "unknown field 'wieght'"),
        ("[tenants.a]\nweight = 0\n", "weight must be a positive number"),
        ("[tenants.a]\nweight = true\n", "weight must be a positive number"),
        ("[tenants.a]\nmax_concurrent_requests = 0\n", "max_concurrent_requests must be"),
        ("[tenants.a]\ntokens_per_second = 1.5\n", "tokens_per_second must be"),
        ("[tenants.a]\nkeys = 'k'\n", "keys must be a list"),
        ("[tenants.a]\nkeys = ['k']\n[tenants.b]\nkeys = ['k']\n", "a key is given twice"),
        ("[tenants.default]\nkeys = ['k']\n", "for requests without a key"),
        ('[tenants."a b"]\n', "a name is 1-64"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_place(text: str, says: str) -> None:
    with pytest.raises(TenantsFileError) as refused:
        parse_book(text, "f.toml")
    message = str(refused.value)
    assert says in message and "\n" not in message and message.startswith("f.toml")


def _rewrite(path: Path, text: str) -> None:
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))  # a change within the same tick shows


def test_a_changed_file_is_reloaded_and_a_bad_one_keeps_the_tenants_in_force(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    source = TenantsFile(str(path))
    assert not source.check()  # unchanged
    _rewrite(path, GOOD.replace("weight = 2", "weight = 5"))
    assert source.check() and source.book.tenants["alice"].weight == 5
    _rewrite(path, "[tenants.alice\n")
    assert not source.check()
    assert source.book.tenants["alice"].weight == 5 and source.failures == 1
    assert "not reloaded" in caplog.text
    assert not source.check()  # the same bad version is not reported again
    assert source.failures == 1
    _rewrite(path, "[tenants.carol]\nkeys = ['sk-carol']\n")
    assert source.check() and source.book.by_key(b"sk-carol") == Tenant("carol")
    path.unlink()
    assert not source.check() and source.book.by_key(b"sk-carol") is not None


def test_a_missing_file_at_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match="cannot be read"):
        TenantsFile(str(tmp_path / "none.toml"))


def test_keys_authenticate_and_name_the_tenant(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    source = TenantsFile(str(path))
    by_key = Tenancy("router-key", source)
    assert by_key.requires_key()
    assert by_key.tenant_of(b"sk-bob") == Tenant("bob")
    assert by_key.tenant_of(b"router-key") == source.book.default
    assert by_key.tenant_of(b"wrong") is None and by_key.tenant_of(None) is None
    # A trusted gateway names the tenant; keys still authenticate.
    gateway = Tenancy(None, source, "X-Tenant")
    assert gateway.header == "x-tenant"
    assert gateway.tenant_of(b"sk-bob", "alice").name == "alice"
    assert gateway.tenant_of(b"sk-bob", "nobody").name == DEFAULT
    assert gateway.tenant_of(b"sk-bob", None).name == DEFAULT
    assert gateway.tenant_of(None, "alice") is None
    # Without keys anywhere, nothing is required and all are the default tenant's.
    open_door = Tenancy(None, None)
    assert not open_door.requires_key() and open_door.tenant_of(None) == Tenant()


def test_a_bad_file_at_start_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trio_pdrouter.cli import parse_config

    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\nweight = -1\n")
    base = ["--worker-urls", "http://127.0.0.1:9"]
    with pytest.raises(SystemExit) as exited:
        parse_config([*base, "--tenants-file", str(path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "weight must be a positive number" in err and "\n" not in err
    with pytest.raises(SystemExit) as exited:
        parse_config([*base, "--tenant-header", "x-tenant"])
    assert exited.value.code == 2 and "--tenants-file" in capsys.readouterr().err
    path.write_text(GOOD)
    config = parse_config([*base, "--tenants-file", str(path), "--tenant-header", "x-tenant"])
    assert config.admission.tenants_file == str(path)


def test_a_file_names_at_most_max_tenants() -> None:
    from trio_pdrouter.tenants import MAX_TENANTS

    many = "".join(f"[tenants.t{i}]\n" for i in range(MAX_TENANTS + 1))
    with pytest.raises(TenantsFileError, match=f"at most {MAX_TENANTS}"):
        parse_book(many)
    assert len(parse_book("".join(f"[tenants.t{i}]\n" for i in range(MAX_TENANTS))).tenants) > 1
