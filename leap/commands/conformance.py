"""`leap conformance SERVICE ADDRESS`: check that the service at ADDRESS, written in any
language, keeps the contract the other LEAP services rely on: the standard health service
answers SERVING for it, server reflection lists it with every RPC of the v1 contract, every
RPC answers, bad input gets INVALID_ARGUMENT naming the field (NOT_FOUND for unknown
tasks, models and runs), and the semantics callers depend on hold.

Safe against a production service: the checks only read, send requests the contract makes
invalid, and use dry runs. They never commit a weight update, record gate history or start
a run. (Rank calls are counted in the reward service's GetStats; Evaluate compiles and runs
the task's own cpu examples; Generate samples a few tokens.)

Exit code 0 when no check fails (a SKIP says why it did not apply), 1 when one does, 2 when
the service name is wrong or nothing answers at ADDRESS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from leap.clients import STUBS
from leap.runtime.config import SecretOnCommandLine


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("conformance", help="check that a service keeps its contract (read-only)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("service", metavar="SERVICE", help=f"contract to check: {', '.join(STUBS)}")
    parser.add_argument("address", metavar="ADDRESS",
                        help="gRPC target, for example 127.0.0.1:50052 or dns:///sandbox:50052")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--auth-token-file", metavar="FILE",
                        help="file holding the bearer token to send (default: the token in $LEAP_AUTH_TOKEN)")
    parser.add_argument("--auth-token", action=SecretOnCommandLine, help=argparse.SUPPRESS)
    parser.add_argument("--tls-ca", help="PEM CA file: connect with TLS, trusting this CA")
    parser.add_argument("--tls-cert", help="PEM client certificate (mTLS), with --tls-key")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of each call, in seconds (default 60)")
    parser.add_argument("--connect-timeout", type=float, default=10.0,
                        help="how long to wait for ADDRESS to answer at all, in seconds (default 10)")
    parser.add_argument("--model", help="policy: the model to check (default: 'policy' if loaded, else the first)")
    parser.add_argument("--logprob-tolerance", type=float, default=None,
                        help="policy: largest difference between Score and Generate logprobs, in nats (default 0.01)")
    parser.set_defaults(func=run)


def auth_token(args) -> str | None:
    """The token from --auth-token-file, else $LEAP_AUTH_TOKEN (never a flag: ps shows flags)."""
    from leap.cli import UserError
    from leap.runtime.config import read_token_file

    if args.auth_token_file:
        try:
            return read_token_file(args.auth_token_file)
        except ValueError as err:
            raise UserError(str(err)) from None
    return os.environ.get("LEAP_AUTH_TOKEN") or None


def run(args, _extra) -> int:
    from leap.cli import UserError
    from leap.conformance import Outcome, Unreachable, check_service, failures

    if args.service not in STUBS:
        raise UserError(f"unknown service {args.service!r}; choose one of: {', '.join(STUBS)}")
    options = {"model": args.model, "logprob_tolerance": args.logprob_tolerance}
    try:
        results = check_service(args.service, args.address, deadline=args.timeout,
                                connect_seconds=args.connect_timeout, options=options, auth_token=auth_token(args),
                                tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
    except Unreachable as err:
        raise UserError(str(err)) from None
    except OSError as err:  # a TLS file that cannot be read
        raise UserError(f"cannot read {err.filename}: {err.strerror}") from None
    if args.json:
        print(json.dumps({"service": args.service, "address": args.address, "ok": not failures(results),
                          "checks": [dataclasses.asdict(r) | {"outcome": r.outcome.value} for r in results]},
                         indent=2))
    else:
        print(table(results))
        counts = {outcome: sum(r.outcome is outcome for r in results) for outcome in Outcome}
        print(f"\n{args.service} at {args.address}: {counts[Outcome.PASS]} passed, {counts[Outcome.FAIL]} failed, "
              f"{counts[Outcome.SKIP]} skipped")
    return 1 if failures(results) else 0


def table(results) -> str:
    rows = [("CHECK", "RESULT", "WHY"), *((r.check, r.outcome.value, r.why) for r in results)]
    width = max(len(check) for check, _, _ in rows)
    return "\n".join(f"{check:<{width}}  {outcome:<6}  {why}" for check, outcome, why in rows)
