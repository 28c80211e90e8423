"""`--swap-space-remote` URLs: the forms that parse, and one-line errors that name the
fix for the rest; passwords only from the environment or a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.remote.url import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    RemoteUrl,
    parse_remote_url,
    remote_password,
)


def test_mooncake_defaults_and_options() -> None:
    # The metadata server defaults to the master's host; TCP unless RDMA is asked.
    url = parse_remote_url("mooncake://10.0.0.5:50051")
    assert (url.scheme, url.host, url.port, url.options) == (
        "mooncake",
        "10.0.0.5",
        50051,
        (),
    )
    rdma = parse_remote_url(
        "mooncake://m:1?metadata=http://meta:9/metadata&protocol=rdma&device=mlx5_0"
    )
    assert rdma.option("metadata") == "http://meta:9/metadata"
    assert rdma.option("protocol") == "rdma" and rdma.option("device") == "mlx5_0"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("redis://h:6379", RemoteUrl("redis", "h", 6379)),
        ("redis://alice@h:6380/3", RemoteUrl("redis", "h", 6380, (), "alice", 3)),
        ("rediss://h:1", RemoteUrl("rediss", "h", 1)),
        ("redis+cluster://h:7000", RemoteUrl("redis+cluster", "h", 7000)),
        (
            "rediss+cluster://bob@h:7000",
            RemoteUrl("rediss+cluster", "h", 7000, (), "bob"),
        ),
        (
            "py://my_pkg.mod:Store?a=1",
            RemoteUrl("py", "my_pkg.mod:Store", None, (("a", "1"),)),
        ),
    ],
)
def test_forms_that_parse(text: str, expected: RemoteUrl) -> None:
    # Each documented form parses to its parts.
    assert parse_remote_url(text) == expected


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        ("localhost:6379", "mooncake://HOST:PORT"),
        ("memcached://h:1", "use one of"),
        ("redis://:6379", "redis://HOST:PORT"),
        ("redis://h", "redis://h:6379"),
        ("mooncake://h", "mooncake://h:50051"),
        ("redis://h:99999", "1 to 65535"),
        ("redis://h:port", "1 to 65535"),
        ("redis://alice:secret@h:6379", PASSWORD_ENV),
        ("redis://h:1/x", "database number"),
        ("redis+cluster://h:1/2", "remove the path"),
        ("redis://h:1?ssl_ca_certs=/x", "allowed here: none"),
        ("rediss://h:1?ssl_ca_certs=/no/such/file", "CA bundle"),
        ("mooncake://h:1?protocol=udp", "protocol=tcp or protocol=rdma"),
        ("mooncake://h:1?device=mlx5_0", "add protocol=rdma"),
        ("mooncake://h:1?metadata=meta:80", "metadata=http://HOST:PORT/metadata"),
        ("mooncake://h:1?colour=red", "allowed here: device, local_hostname"),
        ("mooncake://h:1?protocol=", "protocol=VALUE"),
        ("mooncake://h:1?protocol=tcp&protocol=rdma", "keep one"),
        ("mooncake://u@h:1", "private network"),
        ("py://just_a_module", "py://my_pkg.module:MyStore"),
        ("redis://h :1", "remove it"),
    ],
)
def test_errors_are_one_line_and_name_the_fix(text: str, fix: str) -> None:
    # Every refusal is one line that says what to write instead.
    with pytest.raises(OffloadConfigError) as raised:
        parse_remote_url(text)
    message = str(raised.value)
    assert "\n" not in message
    assert fix in message


def test_password_from_env_or_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The env var, or the file it names (trailing newline dropped); never both.
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_FILE_ENV, raising=False)
    assert remote_password() is None
    monkeypatch.setenv(PASSWORD_ENV, "s3cret")
    assert remote_password() == "s3cret"
    path = tmp_path / "pw"
    path.write_text("from-file\n")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(path))
    with pytest.raises(OffloadConfigError, match="unset one of them"):
        remote_password()
    monkeypatch.delenv(PASSWORD_ENV)
    assert remote_password() == "from-file"
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(path) + ".missing")
    with pytest.raises(OffloadConfigError, match="readable file"):
        remote_password()


@pytest.mark.parametrize("text", ["rediss://alice:hunter2@h:6379", "alice:hunter2@h:1"])
def test_refused_url_does_not_echo_the_password(text: str) -> None:
    # The error for a URL with a password shows neither the password nor the user.
    with pytest.raises(OffloadConfigError) as raised:
        parse_remote_url(text)
    assert "hunter2" not in str(raised.value) and "alice" not in str(raised.value)
