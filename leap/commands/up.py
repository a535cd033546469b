"""`leap up`: start the whole stack as local processes on loopback, wait until every health
check is SERVING, print where each listens, and stop them all on Ctrl-C."""

from __future__ import annotations

import time

from leap.runtime.config import SERVICES


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("up", help="start the whole stack locally", description=__doc__)
    parser.add_argument("--services", default=",".join(SERVICES),
                        help=f"comma-separated services to start (default: {','.join(SERVICES)})")
    parser.add_argument("--config", metavar="FILE", help="TOML file with a table per service, for example [sandbox]")
    parser.add_argument("--log-dir", default="runs/logs", help="where each service's JSON log goes (default runs/logs)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for SERVING (default 300)")
    parser.add_argument("--check", action="store_true", help="start, check every health, print, and stop again")
    parser.set_defaults(func=run)


def run(args, _extra) -> int:
    from leap.cli import UserError
    from leap.commands.health import check
    from leap.stack import LocalStack

    names = [name.strip() for name in args.services.split(",") if name.strip()]
    unknown = [name for name in names if name not in SERVICES]
    if unknown:
        raise UserError(f"unknown service(s) {', '.join(unknown)}; choose from {', '.join(SERVICES)}")
    stack = LocalStack(services=names, config_file=args.config, log_dir=args.log_dir)
    print(f"starting {', '.join(names)} (logs in {args.log_dir}/) ...", flush=True)
    try:
        stack.start(timeout=args.timeout)
    except (RuntimeError, TimeoutError, ValueError) as err:
        raise UserError(str(err)) from None
    try:
        width = max(len(n) for n in names)
        for name, address in stack.addresses.items():
            print(f"  {name:<{width}}  {address}  {check(address)}")
        if args.check:
            return 0
        print("stack is up; press Ctrl-C to stop it", flush=True)
        while all(child.process.poll() is None for child in stack.children.values()):
            time.sleep(0.5)
        dead = [c for c in stack.children.values() if c.process.poll() is not None]
        for child in dead:
            print(f"{child.name} exited with code {child.process.returncode}; last log lines:\n{child.log_tail()}")
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stack.stop()
        print("stopped")
