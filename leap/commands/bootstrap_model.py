"""`leap bootstrap-model DIR`: build the embedded default's tiny model from the task suite (a
byte-level BPE tokenizer, a small Qwen2-style model, a supervised warm start on the suite's
example solutions and broken variants) into DIR, a Hugging Face model directory that both
policy backends load. Cached: a second run with the same suite and settings is instant."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path


def add_parser(subparsers) -> None:
    from leap.bootstrap import BootstrapConfig, default_cache_dir

    defaults = BootstrapConfig()
    parser = subparsers.add_parser("bootstrap-model", help="build the tiny model of the embedded default",
                                   description=__doc__)
    parser.add_argument("directory", metavar="DIR", help="where the model directory goes (new, or an earlier one)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help=f"seed of everything (default {defaults.seed})")
    parser.add_argument("--epochs", type=float, default=defaults.epochs,
                        help=f"passes over the training dialogues (default {defaults.epochs:g})")
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps,
                        help=f"cap on optimizer steps (default {defaults.max_steps})")
    parser.add_argument("--toolchains", default=",".join(defaults.toolchains),
                        help=f"example toolchains to train on, comma-separated (default {','.join(defaults.toolchains)})")
    parser.add_argument("--splits", default=",".join(defaults.splits),
                        help=f"task splits whose examples are trained on (default {','.join(defaults.splits)})")
    parser.add_argument("--tasks", action="append", default=[], metavar="DIR",
                        help="an extra task directory to include (repeatable)")
    parser.add_argument("--cache-dir", default=None,
                        help=f"where built models are cached (default {default_cache_dir()}, or $LEAP_CACHE_DIR)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args, _extra) -> int:
    from leap.bootstrap import TOOLCHAIN_NAMES, BootstrapConfig, bootstrap_model
    from leap.cli import UserError

    toolchains = tuple(t.strip() for t in args.toolchains.split(",") if t.strip())
    unknown = [t for t in toolchains if t not in TOOLCHAIN_NAMES]
    if unknown or not toolchains:
        raise UserError(f"--toolchains: choose from {', '.join(TOOLCHAIN_NAMES)}, not {args.toolchains!r}")
    splits = tuple(s.strip() for s in args.splits.split(",") if s.strip())
    if not splits or any(s not in ("train", "heldout") for s in splits):
        raise UserError(f"--splits: train, heldout or both, not {args.splits!r}")
    if args.epochs <= 0 or args.max_steps < 1:
        raise UserError("--epochs must be positive and --max-steps at least 1")
    try:
        from leap.tasks import load_suite

        tasks = load_suite(extra_dirs=[Path(d) for d in args.tasks])
    except (ImportError, OSError, ValueError, KeyError) as err:
        raise UserError(f"cannot load the task suite: {err}") from None
    config = dataclasses.replace(BootstrapConfig(), seed=args.seed, epochs=args.epochs, max_steps=args.max_steps,
                                 toolchains=toolchains, splits=splits)
    started = time.perf_counter()
    try:
        out = bootstrap_model(args.directory, tasks=tasks, config=config, cache_dir=args.cache_dir,
                              progress=not args.quiet)
    except (FileExistsError, ValueError) as err:
        raise UserError(str(err)) from None
    manifest = json.loads((out / "bootstrap.json").read_text())
    took = time.perf_counter() - started
    print(f"{out}: {manifest['parameters']:,} parameters, vocabulary {manifest['vocab_size']}, "
          f"{manifest['dialogues']} dialogues of {len(manifest['tasks'])} tasks, {manifest['steps']} steps, "
          f"final loss {manifest['final_loss']:.3f}; "
          + (f"built in {manifest['seconds']:.0f} s" if took > 0.5 * manifest["seconds"] else f"from the cache in {took:.1f} s"))
    return 0
