"""`leap serve SERVICE`: run one service in the foreground until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from leap.commands import SERVICE_MODULES, service_spec
from leap.runtime import config as cfg

LEARNER_SERVICES = ("trainer", "distill")  # services whose runs train a model, on one or many processes


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run one service",
        description="Run one service. Every setting is also a flag and an environment variable; "
        "`leap serve SERVICE --help` lists them.",
        add_help=False,
    )
    parser.add_argument("service", nargs="?", choices=list(SERVICE_MODULES), help="service to run")
    parser.add_argument("-h", "--help", action="store_true", help="show the settings of SERVICE")
    parser.set_defaults(func=run, accepts_extra=True)


def settings_parser(spec) -> argparse.ArgumentParser:
    """A parser with one flag per field of the service's config class."""
    parser = argparse.ArgumentParser(
        prog=f"leap serve {spec.name}",
        description=f"{spec.description} Settings come from (lowest first) defaults, --config FILE (TOML), "
        f"environment variables LEAP_{spec.name.upper()}_<SETTING>, and flags.",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file of settings (a [%s] table or top-level keys)" % spec.name)
    for field in cfg.fields_of(spec.config_class):
        if field.metadata.get("flag", True) is False:  # a secret: refused with the reason
            parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name, default=None,
                                action=cfg.SecretOnCommandLine, help=argparse.SUPPRESS)
            continue
        kind = cfg.field_type(spec.config_class, field)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        flag = "--" + field.name.replace("_", "-")
        metavar = "LIST" if typing.get_origin(kind) is list else ("BOOL" if kind is bool else field.name.upper())
        parser.add_argument(
            flag,
            dest=field.name,
            default=None,
            metavar=metavar,
            help=f"{field.metadata.get('help', '')} [env {cfg.env_name(spec.name, field.name)}; default {default!r}]",
        )
    return parser


def load_settings(spec, argv: list[str]):
    from leap.cli import UserError

    from leap.runtime.server import check_tls

    args = settings_parser(spec).parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        settings = cfg.load(spec.config_class, spec.name, config_file=args.config, overrides=overrides)
        check_tls(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    except ValueError as err:
        raise UserError(str(err)) from None
    return settings


def run(args, extra: list[str]) -> int:
    from leap.cli import UserError
    from leap.runtime.errors import StartupError
    from leap.runtime.server import run as run_server

    if args.service is None:
        raise UserError("which service? choose one of: " + ", ".join(SERVICE_MODULES))
    spec = service_spec(args.service)
    if args.help:
        settings_parser(spec).print_help()
        return 0
    settings = load_settings(spec, extra)
    if args.service not in LEARNER_SERVICES:
        try:
            run_server(spec, settings)
        except (OSError, StartupError) as err:
            raise UserError(str(err)) from None
        return 0
    from leap.learning.distributed import current_world, exit_process, release_followers

    world = current_world()
    if learner_driver(spec.name, settings.log_level):
        try:
            run_server(spec, settings)
        except (OSError, StartupError) as err:
            raise UserError(str(err)) from None
        finally:
            release_followers(world)
    # a follower rank under torchrun trained in lockstep with rank 0 and is done; either rank
    # ends here, past the teardown that can abort a distributed process (exit_process)
    if world.distributed:
        exit_process(0)
    return 0


def learner_driver(service: str = "", log_level: str = "info") -> bool:
    """Under `torchrun --nproc-per-node N -m leap serve trainer` every rank joins one process
    group; rank 0 serves and drives, the others replay its learner's calls (FSDP) until it
    shuts down, logging JSON lines as rank 0 does. Returns whether this process is rank 0
    (True with a single process)."""
    from leap.learning.distributed import current_world, leave_process_group
    from leap.learning.learner import follow
    from leap.runtime.logging import configure_logging, library_output_as_logs

    world = current_world()
    if world.is_driver:
        return True
    configure_logging(log_level, service=service)
    with library_output_as_logs():
        follow()
    leave_process_group()
    return False
