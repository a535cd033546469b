"""Configuration of a service: documented dataclass fields, filled from (lowest first)
the defaults, a TOML config file, environment variables, and command-line flags.

Every field of a service's config dataclass documents itself through `metadata["help"]`;
the `leap serve` command turns each field into a flag (`--max-queue 64`) and an environment
variable (`LEAP_SANDBOX_MAX_QUEUE=64`). Fields of `ServerConfig` also accept a variable
without the service name (`LEAP_LOG_LEVEL`), which the service-specific one overrides.

A config file is TOML. When it has a table named after the service (`[sandbox]`), that
table is used, so one file can configure a whole stack; otherwise its top-level keys are.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_PORTS = {"policy": 50051, "sandbox": 50052, "reward": 50053, "trainer": 50054, "distill": 50055}
SERVICES = tuple(DEFAULT_PORTS)


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A documented config field."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help, **kwargs})
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def local_address(service: str) -> str:
    """Where the local stack (`leap up`) serves `service`."""
    return f"127.0.0.1:{DEFAULT_PORTS[service]}"


@dataclasses.dataclass
class ServerConfig:
    """Settings every service shares: where it listens and how it talks."""

    host: str = option("127.0.0.1", "Address to bind; 0.0.0.0 listens on every interface.")
    port: int = option(0, "Port to listen on; 0 means the service's default port.")
    log_level: str = option("info", "Lowest level logged: debug, info, warning or error.")
    max_message_bytes: int = option(64 * 1024 * 1024, "Largest request or response message, in bytes.")
    keepalive_seconds: float = option(30.0, "Interval of HTTP/2 keepalive pings on idle connections, in seconds.")
    drain_seconds: float = option(1.0, "On SIGTERM, how long health reports NOT_SERVING while calls are still accepted, "
                                  "so load balancers and probes move away first, in seconds.")
    grace_seconds: float = option(10.0, "After the drain, how long in-flight calls may take to finish, in seconds.")
    auth_token: str = option("", "When set, every call but health checks must send 'authorization: Bearer <token>'. "
                                 "From the environment (LEAP_AUTH_TOKEN) or a config file only: a flag would show "
                                 "the token to every user of the machine (ps, /proc/PID/cmdline).", flag=False)
    auth_token_file: str = option("", "A file holding the token of auth_token (surrounding whitespace ignored), read at "
                                      "start; for secrets mounted as files (Docker and Kubernetes secrets).")
    tls_cert: str = option("", "PEM certificate file; with tls_key, serve TLS instead of plaintext.")
    tls_key: str = option("", "PEM private key file of tls_cert.")
    tls_client_ca: str = option("", "PEM CA file; when set, clients must present a certificate it signed (mTLS).")
    allow_unauthenticated: bool = option(False, "Serve on an address beyond loopback (host 0.0.0.0, say) without "
                                         "auth_token or tls_client_ca; without it such a server refuses to start.")


COMMAND_LINE_SECRET = ("is not accepted on the command line: every user of the machine can read a command line "
                       "(ps, /proc/PID/cmdline). Use the LEAP_AUTH_TOKEN environment variable or a token file "
                       "(--auth-token-file FILE)")


class SecretOnCommandLine(argparse.Action):
    """An argparse action for a flag that must not carry a secret: it fails with the reason."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {COMMAND_LINE_SECRET}")


def read_token_file(path: str | os.PathLike) -> str:
    """The token in `path` (surrounding whitespace stripped); ValueError names the file."""
    try:
        token = Path(path).read_text().strip()
    except OSError as err:
        raise ValueError(f"auth_token_file {str(path)!r} cannot be read: {err.strerror or err}") from None
    if not token:
        raise ValueError(f"auth_token_file {str(path)!r} is empty")
    return token


def resolve_auth_token(config: ServerConfig) -> str:
    """The token every call must carry: auth_token, else the content of auth_token_file."""
    if config.auth_token and config.auth_token_file:
        raise ValueError("set auth_token or auth_token_file, not both")
    if config.auth_token_file:
        return read_token_file(config.auth_token_file)
    return config.auth_token


def fields_of(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def field_type(cls: type, f: dataclasses.Field) -> Any:
    return typing.get_type_hints(cls)[f.name]


def parse_value(kind: Any, raw: Any, name: str) -> Any:
    """Convert a string (from a flag or the environment) or a TOML value to the field's type."""
    origin = typing.get_origin(kind)
    if origin is list:
        (item,) = typing.get_args(kind)
        items = raw if isinstance(raw, list) else [part for part in str(raw).split(",") if part.strip()]
        return [parse_value(item, part.strip() if isinstance(part, str) else part, name) for part in items]
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{name}: expected true or false, got {raw!r}")
    if kind in (int, float):
        try:
            return kind(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    return str(raw)


def env_name(service: str, field_name: str) -> str:
    return f"LEAP_{service.upper()}_{field_name.upper()}"


def env_names(cls: type, service: str, field_name: str) -> list[str]:
    """The environment variables a setting is read from, weakest first: server settings also
    take the suite-wide `LEAP_<SETTING>` (one LEAP_AUTH_TOKEN for every service)."""
    generic = [f"LEAP_{field_name.upper()}"] if field_name in {f.name for f in fields_of(ServerConfig)} else []
    return [*generic, env_name(service, field_name)]


def load(
    cls: type[T],
    service: str,
    *,
    config_file: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build `cls` for `service` from defaults < config file < environment < overrides."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    known = {f.name: f for f in fields_of(cls)}
    if config_file:
        table = read_config_file(config_file, service)
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ValueError(f"{config_file}: unknown setting(s) for {service}: {', '.join(unknown)}")
        values.update(table)
    for name in known:
        for variable in env_names(cls, service, name):  # the service's own name last: it wins
            if variable in env:
                values[name] = env[variable]
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
    parsed = {name: parse_value(field_type(cls, known[name]), value, name) for name, value in values.items()}
    config = cls(**parsed)
    if isinstance(config, ServerConfig) and config.auth_token_file:
        config.auth_token = resolve_auth_token(config)  # read now: a missing file is a start-up error
    return config


def read_config_file(path: str | os.PathLike, service: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config file {str(file)!r} does not exist")
    try:
        data = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {str(file)!r} is not valid TOML: {err}") from None
    if isinstance(data.get(service), dict):
        return {k.replace("-", "_"): v for k, v in data[service].items()}
    return {k.replace("-", "_"): v for k, v in data.items() if not isinstance(v, dict) or k not in SERVICES}


def describe(cls: type, service: str) -> str:
    """A table of every setting with its default, flag and environment variable (for --help-config)."""
    lines = []
    for f in fields_of(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        flag = f"--{f.name.replace('_', '-')}" if f.metadata.get("flag", True) else "(no flag)"
        lines.append(f"  {flag:<30} {env_name(service, f.name):<40} default: {default!r}")
        lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)
