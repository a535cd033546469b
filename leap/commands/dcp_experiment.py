"""`leap dcp-experiment`: what Difficulty-Conditioned Pruning buys. It trains the same model
with the same seed and the same number of steps in three modes — `leap` (DCP gate and rank
reward), `multiturn` (every group with a failure gets debugging turns) and `single` (one
turn) — each on a fresh stack of its own (its own compile cache and reward history, so no
mode inherits another's warm caches), then writes a table and a plot of pass@1 by turn —
on fresh samples of the training tasks, and on the held-out tasks — against the sandbox
evaluations and the wall-clock seconds each mode spent, and how much less LEAP spent than
multiturn to reach the same accuracy on the training tasks at the last turn (the lower of
the two modes' final ones). Every mode runs once per seed (`--seeds`, default 3); with more
than one, the top report gives each figure's mean and standard error over the seeds and says,
claim by claim, on how many seeds the paper's claims held. A mode that finished before in the
same --out with the same settings, tasks and model is read back rather than run again, so an
experiment that stopped goes on from its first unfinished mode.

The tasks are `leap demo`'s (`--task-families`, default the elementwise family's tier 1): the
model is warm-started on the training split, every mode trains on it and is measured on the
first 48 training tasks (fresh samples) and on the held-out split; `--task-families none`
runs on the built-in suite instead.

The seed paper reports LEAP reaching the same accuracy 1.93x faster than unpruned
multi-turn while expanding 43.9% of groups; this command reports what this machine gives."""

from __future__ import annotations

import json
from pathlib import Path

MODES = {"leap": "TRAIN_MODE_LEAP", "multiturn": "TRAIN_MODE_MULTITURN", "single": "TRAIN_MODE_SINGLE"}


def add_parser(subparsers) -> None:
    from leap.commands.demo import add_training_options

    parser = subparsers.add_parser("dcp-experiment", help="compare LEAP, unpruned multi-turn and single-turn training",
                                   description=__doc__)
    parser.add_argument("--out", default="runs/dcp-experiment", help="output directory (default runs/dcp-experiment)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)} (default all)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds to repeat every mode with: --seed, --seed + 1, ... "
                                                             "(default 3); the report gives each figure's mean and "
                                                             "standard error over them")
    add_training_options(parser, eval_every=5)
    parser.set_defaults(func=run)


def run(args, _extra) -> int:
    from leap.cli import UserError
    from leap.commands.demo import bootstrap, check_args, demo_toolchain, say
    from leap.experiments.compare import seed_dir
    from leap.experiments.runs import RunFailed

    check_args(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise UserError(f"--modes: choose from {', '.join(MODES)}, not {args.modes!r}")
    if args.seeds < 1:
        raise UserError("--seeds must be at least 1")
    out = Path(args.out)
    toolchain = demo_toolchain()
    model = Path(args.model) if args.model else bootstrap(out / "model", toolchain, args.tasks, args.quiet)
    seeds = [args.seed + number for number in range(args.seeds)]
    per_seed, runs_by_seed = [], []
    for seed in seeds:
        work, runs = seed_dir(out, seed, len(seeds)), {}
        for mode in modes:
            say(f"\n== {mode}, seed {seed} ==")
            try:
                runs[mode] = train_mode(args, mode, model, toolchain, work / mode, seed)
            except (RunFailed, RuntimeError, TimeoutError) as err:
                raise UserError(f"{mode}, seed {seed}: {err}") from None
        per_seed.append(report(args, runs, work, seed))
        runs_by_seed.append(runs)
    if len(seeds) > 1:
        report_seeds(args, seeds, per_seed, out, runs_by_seed)
    return 0


def metrics_of(turns: int) -> list[str]:
    """The reported metrics: pass@1 at turn 1 and the last, on training tasks then held-out ones."""
    return [f"{prefix}pass_at_1/turn_{t}" for prefix in ("train_tasks/", "") for t in dict.fromkeys((1, turns))]


def train_mode(args, mode: str, model: Path, toolchain: int, work: Path, seed: int) -> list[dict]:
    """One mode on a stack of its own; its events as plain dicts."""
    from google.protobuf import json_format

    from leap.clients import connect
    from leap.commands.demo import evaluation_fields, families_env, say, speed_fields, split_ids
    from leap.common.v1 import common_pb2
    from leap.experiments.resume import save_finished
    from leap.experiments.runs import run_to_end
    from leap.experiments.stack import experiment_stack
    from leap.trainer.v1 import trainer_pb2

    train_ids, held_out_ids = split_ids(args.tasks)
    config = trainer_pb2.RunConfig(
        model_path=str(model.resolve()), steps=args.steps, tasks_per_step=args.tasks_per_step,
        group_size=args.group_size, mode=trainer_pb2.TrainMode.Value(MODES[mode]),
        max_turns=1 if mode == "single" else args.max_turns, eval_turns=args.max_turns, toolchain=toolchain,
        seed=seed, **evaluation_fields(args), train_tasks=train_ids, eval_tasks=held_out_ids,
        display_name=f"dcp {mode}",
        checkpoint_every=args.steps, optimizer=common_pb2.OptimizerConfig(learning_rate=args.learning_rate),
        **speed_fields(args.speed_rank, toolchain))
    record, stamp = work / "events.json", finished_stamp(config, args.task_families, model)
    if (events := finished_events(record, stamp)) is not None:
        say(f"{mode}, seed {seed}: finished before with these settings; its events are read back from {record} "
            "(delete the directory to run it again)")
        return events
    with experiment_stack(work, model, extra_env=families_env(args.task_families)) as stack:
        trainer = connect("trainer", stack.addresses["trainer"], aio=False)
        try:
            finished = run_to_end(trainer, trainer_pb2, config, mode, progress=not args.quiet,
                                  postfix_keys=("pass_at_1/turn_1", "expanded_share"))
        finally:
            trainer.channel.close()
    events = [json_format.MessageToDict(e, preserving_proto_field_name=True) for e in finished.events]
    for event in events:
        event.setdefault("values", {})
        event["step"] = int(event.get("step", 0))
    save_finished(record, stamp, "events", events)
    return events


def finished_stamp(config, task_families: str, model: Path) -> dict:
    """What decides a mode's run: its RunConfig, the generated tasks and the model."""
    from google.protobuf import json_format

    from leap.experiments.resume import model_stamp

    return {"config": json_format.MessageToDict(config, preserving_proto_field_name=True),
            "task_families": task_families, "model": model_stamp(model)}


def finished_events(record: Path, stamp: dict) -> list[dict] | None:
    """A finished run's events when `record` holds one made with `stamp`, else None: an
    experiment that stopped picks up at its first unfinished mode."""
    from leap.experiments.resume import finished

    events = finished(record, stamp, "events")
    return events if isinstance(events, list) else None


def report(args, runs: dict[str, list[dict]], out: Path, seed: int) -> dict:
    """One seed's table, plot and claims; returns its {mode: Summary}."""
    from leap.commands.demo import say
    from leap.experiments import compare

    turns = args.max_turns
    metrics = metrics_of(turns)
    target_metric = metrics[len(metrics) // 2 - 1]  # the training tasks at the last turn: what training improves
    reference = "multiturn" if "multiturn" in runs else next(iter(runs))
    # The common accuracy: the lower of LEAP's and multiturn's last, which both reached.
    finals = [compare.curve(runs[name], target_metric) for name in ("leap", reference) if name in runs]
    target = min((points[-1].accuracy for points in finals if points), default=0.0)
    summaries = [compare.summarize(name, events, metrics, target_metric, target) for name, events in runs.items()]
    table = compare.markdown_table(summaries, metrics, f"{target:.3f}")
    lines = [f"# DCP experiment: {args.steps} steps per mode, B={args.tasks_per_step}, G={args.group_size}, "
             f"K={turns}, seed {seed}", "", table, ""]
    by_name = {s.name: s for s in summaries}
    if "leap" in by_name and reference == "multiturn":
        leap, multi = by_name["leap"], by_name["multiturn"]
        if leap.reached and multi.reached:
            lines.append(f"Both reached {compare.label(target_metric)} {target:.3f}; LEAP got there with "
                         f"{compare.ratio(multi.reached.seconds, leap.reached.seconds):.2f}x less wall-clock and "
                         f"{compare.ratio(multi.reached.evaluations, leap.reached.evaluations):.2f}x fewer sandbox "
                         f"evaluations (paper: 1.93x faster; 43.9% of groups expanded, here "
                         f"{leap.expanded_share:.1%}).")
        else:
            lines.append(f"One of LEAP and multiturn did not reach {compare.label(target_metric)} {target:.3f} within "
                         f"{args.steps} steps; it spent {compare.ratio(multi.evaluations, leap.evaluations):.2f}x fewer "
                         f"sandbox evaluations and {compare.ratio(multi.seconds, leap.seconds):.2f}x less wall-clock "
                         f"in all, expanding {leap.expanded_share:.1%} of groups.")
    lines += ["", "The papers' claims on this seed:", *compare.dcp_claims([by_name], metrics[-1])]
    plot = compare.plot_curves(runs, [target_metric, metrics[-1]], out / "dcp.png", title="pass@1 against training cost")
    lines += ["", f"plot: {plot}"]
    text = "\n".join(lines)
    (out / "report.md").write_text(text + "\n")
    (out / "report.json").write_text(json.dumps({s.name: {"final": s.final, "evaluations": s.evaluations,
                                                          "seconds": s.seconds, "expanded_share": s.expanded_share,
                                                          "reached": s.reached.__dict__ if s.reached else None}
                                                 for s in summaries}, indent=2) + "\n")
    say("\n" + text + f"\nreport: {out / 'report.md'}")
    return by_name


def report_seeds(args, seeds: list[int], per_seed: list[dict], out: Path,
                 runs_by_seed: list[dict[str, list[dict]]]) -> None:
    """The figures over seeds (mean ± standard error), whether each claim held on every seed, and
    the plot of the mean curves."""
    from leap.commands.demo import say
    from leap.experiments import compare

    metrics = metrics_of(args.max_turns)
    spreads = compare.across_seeds(per_seed, metrics)
    claims = compare.dcp_claims(per_seed, metrics[-1])
    lines = [f"# DCP experiment over seeds {', '.join(map(str, seeds))}: {args.steps} steps per mode, "
             f"B={args.tasks_per_step}, G={args.group_size}, K={args.max_turns}", "",
             compare.seeds_table(spreads, metrics, len(seeds)), "",
             "Before training (the step-0 evaluation, mean ± standard error over the seeds): "
             + ", ".join(f"{compare.label(m)} {value}" for m, value in compare.before_training(runs_by_seed, metrics).items()),
             "", "The papers' claims, seed by seed:",
             *claims, "",
             "each seed's table, plot and runs: " + ", ".join(str(compare.seed_dir(out, s, len(seeds))) for s in seeds)]
    target_metric = metrics[len(metrics) // 2 - 1]  # as in each seed's report: the training tasks at the last turn
    plot = compare.plot_seeds(runs_by_seed, [target_metric, metrics[-1]], out / "dcp.png",
                              title=f"pass@1 against training cost, mean over seeds {', '.join(map(str, seeds))}")
    lines += ["", f"plot: {plot}"]
    text = "\n".join(lines)
    (out / "report.md").write_text(text + "\n")
    (out / "report.json").write_text(json.dumps({
        "seeds": seeds,
        "runs": {name: {figure: value.to_json() for figure, value in figures.items()}
                 for name, figures in spreads.items()},
        "claims": claims,
    }, indent=2) + "\n")
    say("\n" + text + f"\nreport: {out / 'report.md'}")
