"""`leap demo`: the whole system on this machine, in a few minutes. It builds the tiny model
(cached), starts every service on free loopback ports, runs a LEAP training with a progress
bar, and prints what changed between the evaluations before the first step and after the
last: pass@1 by turn (with its standard error over tasks) on held-out tasks the model never
saw, and on fresh samples of some training tasks, speedups, sandbox evaluations spent and
saved by DCP, and where the metrics, plots and samples were written.

The tasks are the generated elementwise family's easiest tier (one or two ops over up to three
inputs; `leap.tasks.families`): the model is warm-started on its training split, LEAP trains
on that split, and the held-out split combines op pairs neither ever saw together. With a
GPU (and nvcc) the toolchain is cuda; without one, C++ on the cpu toolchain."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


DEMO_FAMILIES = "elementwise@1:980"  # the first 980 (by index) of the elementwise family's 1,016 tier-1 structures
FAMILY_SEED = 0  # the seed of the generated tasks
TRAIN_TASKS_MEASURED = 48  # training tasks measured on fresh samples at each evaluation (the first by id)
# `leap demo`'s evaluation: before the first step and after the last only, on more samples of
# each held-out task and fewer training tasks, which keeps the evaluations' cost near what
# three evaluations of 8 samples on 48 training tasks cost, while the paired standard error of
# the held-out change, almost all of it the sampling noise of 8 samples a task, falls by
# about sqrt(3).
DEMO_EVAL_EVERY, DEMO_EVAL_SAMPLES, DEMO_TRAIN_TASKS_MEASURED = 20, 24, 16


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="train the tiny model with LEAP on this machine and report",
                                   description=__doc__)
    parser.add_argument("--out", default="runs/demo", help="where the model, the services' state and the run go "
                                                           "(default runs/demo)")
    add_training_options(parser, eval_every=DEMO_EVAL_EVERY, eval_samples=DEMO_EVAL_SAMPLES,
                         train_tasks_measured=DEMO_TRAIN_TASKS_MEASURED)
    parser.add_argument("--report-to", default="", metavar="LIST",
                        help="experiment trackers that also get the run's metrics, config and plots: mlflow, wandb, "
                             "trackio, comma-separated; each is an extra (pip install 'leap-suite[mlflow]') and "
                             "writes locally without an account (default: none)")
    parser.set_defaults(func=run)


def add_training_options(parser, *, eval_every: int, eval_samples: int = 8,
                         train_tasks_measured: int = TRAIN_TASKS_MEASURED) -> None:
    """The options `leap demo` and `leap dcp-experiment` share (the evaluation's defaults are
    each command's)."""
    parser.add_argument("--model", metavar="DIR", help="a Hugging Face model directory to train instead of the "
                                                       "bootstrapped tiny model")
    parser.add_argument("--steps", type=int, default=20, help="LEAP steps (default 20)")
    parser.add_argument("--tasks-per-step", type=int, default=8, help="tasks per step, B (default 8)")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per task, G (default 8)")
    parser.add_argument("--max-turns", type=int, default=3, help="turns for expanded groups, K, and the turns of every "
                                                                "evaluation (default 3)")
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="AdamW learning rate (default 5e-4)")
    parser.add_argument("--eval-samples", type=int, default=eval_samples,
                        help=f"samples per task at each evaluation (default {eval_samples})")
    parser.add_argument("--train-tasks-measured", type=int, default=train_tasks_measured, metavar="N",
                        help="training tasks (the first N by id) measured on fresh samples at each evaluation, beside "
                             f"the held-out ones (default {train_tasks_measured}; 0: none)")
    parser.add_argument("--eval-every", type=int, default=eval_every,
                        help=f"evaluation every N steps (default {eval_every}; always before the first and after the last)")
    parser.add_argument("--seed", type=int, default=0, help="seed of everything (default 0)")
    add_task_families_option(parser)
    add_speed_rank_option(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def add_speed_rank_option(parser) -> None:
    parser.add_argument("--speed-rank", choices=("auto", "on", "off"), default="auto",
                        help="whether the rank reward breaks ties between solved rollouts by their measured speed: "
                             "auto (the default) is on with the cuda toolchain and off with the cpu one, where "
                             "timings on a shared CPU are the one input that differs between two runs of the same "
                             "command; off, the sandbox times nothing (about half its work; no speedups are "
                             "reported) and the same command gives the same pass rates every time on one machine")


def add_task_families_option(parser) -> None:
    parser.add_argument("--task-families", default=DEMO_FAMILIES, metavar="LIST",
                        help="the generated tasks to warm-start on, train on and measure, as the sandbox's "
                             "task_families setting: NAME[@TIER][:COUNT], comma-separated, of seed "
                             f"{FAMILY_SEED}; 'none' for the built-in suite (default {DEMO_FAMILIES}: the "
                             "elementwise family's tier 1)")


def check_args(args) -> None:
    from leap.cli import UserError

    for name in ("steps", "tasks_per_step", "max_turns", "eval_samples"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.train_tasks_measured < 0:
        raise UserError("--train-tasks-measured must be at least 0")
    if args.group_size < 2:
        raise UserError("--group-size must be at least 2: rank rewards compare rollouts within a group")
    if args.learning_rate <= 0:
        raise UserError("--learning-rate must be above 0")
    args.tasks = experiment_tasks(args.task_families)
    if args.model:
        from leap.learning import check_model_dir

        if problem := check_model_dir(args.model):
            raise UserError(f"--model: {problem}")


def experiment_tasks(task_families: str) -> list:
    """The tasks a `--task-families` value names (FULL view; the sandbox serves the same ones):
    the built-in suite for 'none'. UserError naming the option for a bad value."""
    from leap.cli import UserError
    from leap.tasks import families, load_suite

    if task_families.strip() == "none":
        return list(load_suite())
    try:
        entries = families.parse_served([e for e in task_families.split(",") if e.strip()])
    except (KeyError, ValueError) as err:
        raise UserError(f"--task-families: {err.args[0] if err.args else err}") from None
    tasks = [task for entry in entries for task in families.served_tasks(entry, FAMILY_SEED)]
    if not any(t.split == "train" for t in tasks) or not any(t.split == "heldout" for t in tasks):
        raise UserError(f"--task-families: {task_families!r} gives no training task or no held-out one; "
                        "serve more of the family (a larger COUNT)")
    return tasks


def families_env(task_families: str) -> dict[str, str]:
    """The sandbox settings that serve a `--task-families` value."""
    if task_families.strip() == "none":
        return {}
    return {"LEAP_SANDBOX_TASK_FAMILIES": task_families, "LEAP_SANDBOX_TASK_FAMILY_SEED": str(FAMILY_SEED)}


def split_ids(tasks: list) -> tuple[list[str], list[str]]:
    """The training and held-out ids of experiment_tasks' result, sorted."""
    return (sorted(t.id for t in tasks if t.split == "train"), sorted(t.id for t in tasks if t.split == "heldout"))


def run(args, _extra) -> int:
    from leap.cli import UserError
    from leap.experiments.runs import RunFailed
    from leap.experiments.stack import experiment_stack

    check_args(args)
    args.trackers = trackers(args.report_to)
    out = Path(args.out)
    toolchain = demo_toolchain()
    tasks = args.tasks
    model = Path(args.model) if args.model else bootstrap(out / "model", toolchain, tasks, args.quiet)
    stack = experiment_stack(out / "stack", model, extra_env=families_env(args.task_families))
    say(f"starting the services (logs in {out / 'stack' / 'logs'}) ...")
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as err:
        raise UserError(str(err)) from None
    try:
        report = train_and_measure(args, stack.addresses, model, toolchain, tasks)
    except RunFailed as err:
        raise UserError(str(err)) from None
    finally:
        stack.stop()
    write_report(report, out)
    return 0


# A rank config's speedup_margin that no two speedups exceed: solved rollouts tie on speed and
# are ranked by their turn and then their length alone (RankConfig's tournament).
NO_SPEED_MARGIN = 1e12


def speed_fields(speed_rank: str, toolchain: int) -> dict:
    """The RunConfig fields for a `--speed-rank` value: on, the rank service's defaults and
    timed verdicts; off, speed left out of the tie-break and the sandbox not asked to time
    anything (about half its work on the cpu toolchain, and the one input that differed
    between two runs)."""
    from leap.common.v1 import common_pb2
    from leap.reward.v1 import reward_pb2

    on = speed_rank == "on" or (speed_rank == "auto" and toolchain == common_pb2.Toolchain.TOOLCHAIN_CUDA)
    if on:
        return {"rank": reward_pb2.RankConfig(), "sandbox_timing": True}
    return {"rank": reward_pb2.RankConfig(speedup_margin=NO_SPEED_MARGIN), "sandbox_timing": False}


def trackers(report_to: str) -> list[str]:
    """`--report-to`'s names, checked here (a tracker runs in the trainer this command starts, in
    this environment) so a mistake is one line before anything starts."""
    from leap.cli import UserError
    from leap.learning import reporters
    from leap.runtime import Violations

    names = reporters.parse_names(report_to)
    violations = Violations()
    reporters.report_to_violations(names, "--report-to", violations)
    if violations.items:
        raise UserError("; ".join(description for _, description in violations.items))
    return names


def say(text: str) -> None:
    print(text, flush=True)


def demo_toolchain() -> int:
    """cuda where a GPU and nvcc are present, else cpu."""
    import shutil

    import torch

    from leap.common.v1 import common_pb2

    if torch.cuda.is_available() and shutil.which("nvcc"):
        return common_pb2.Toolchain.TOOLCHAIN_CUDA
    return common_pb2.Toolchain.TOOLCHAIN_CPU


def bootstrap(directory: Path, toolchain: int, tasks: list, quiet: bool) -> Path:
    """The tiny model warm-started on the training split of `tasks`."""
    from leap.bootstrap import BootstrapConfig, bootstrap_model
    from leap.union import toolchain_name

    say(f"building the tiny model into {directory} (cached after the first time) ...")
    return bootstrap_model(directory, tasks=tasks, config=BootstrapConfig(toolchains=(toolchain_name(toolchain),)),
                           progress=not quiet)


def evaluation_fields(args) -> dict:
    """The RunConfig fields of the evaluations `leap demo` and `leap dcp-experiment` run (before
    the first step, every --eval-every steps and after the last; --train-tasks-measured 0 leaves
    the training tasks out)."""
    return {"eval_every": args.eval_every, "eval_samples": args.eval_samples,
            "eval_train_tasks": args.train_tasks_measured > 0, "eval_train_task_count": args.train_tasks_measured}


def train_and_measure(args, addresses: dict[str, str], model: Path, toolchain: int, tasks: list) -> dict:
    """The LEAP run on the training split of `tasks`, measured by the trainer itself before the first step, every eval_every steps and after the last: the
    held-out split, and the first --train-tasks-measured training tasks on fresh samples."""
    train_ids, held_out_ids = split_ids(tasks)
    from leap.clients import connect
    from leap.common.v1 import common_pb2
    from leap.experiments.runs import TRAIN_TASKS, run_to_end
    from leap.learning.reporters import where_reported
    from leap.trainer.v1 import trainer_pb2

    config = trainer_pb2.RunConfig(
        model_path=str(model.resolve()), steps=args.steps, tasks_per_step=args.tasks_per_step,
        group_size=args.group_size, max_turns=args.max_turns, toolchain=toolchain, seed=args.seed,
        **evaluation_fields(args), train_tasks=train_ids, eval_tasks=held_out_ids,
        checkpoint_every=max(1, args.steps // 2), display_name="leap demo", report_to=getattr(args, "trackers", []),
        optimizer=common_pb2.OptimizerConfig(learning_rate=args.learning_rate),
        **speed_fields(args.speed_rank, toolchain))
    trainer = connect("trainer", addresses["trainer"], aio=False)
    started = time.perf_counter()
    try:
        finished = run_to_end(trainer, trainer_pb2, config, "LEAP", progress=not args.quiet,
                              postfix_keys=("pass_at_1/turn_1", "expanded_share", "loss"))
    finally:
        trainer.channel.close()
    train_events = [dict(e.values) for e in finished.of_kind("train")]
    measured = {key: finished.evaluations(prefix) for key, prefix in (("held_out", ""), ("train_tasks", TRAIN_TASKS))}

    return {
        "run_id": finished.run.run_id, "output_dir": finished.run.output_dir, "seconds": time.perf_counter() - started,
        "steps": args.steps, "turns": args.max_turns, "model": str(model),
        "speed_rank": config.sandbox_timing,
        "task_counts": {"held_out": len(held_out_ids), "train_tasks": min(len(train_ids), args.train_tasks_measured),
                        "trained_on": len(train_ids)},
        **{key: {"before": evals[0], "after": evals[-1]} if evals else {"before": {}, "after": {}}
           for key, evals in measured.items()},
        "sandbox_evaluations": sum(v.get("sandbox/evaluations", 0.0) for v in train_events),
        "sandbox_evaluations_saved": sum(v.get("sandbox/evaluations_saved", 0.0) for v in train_events),
        "expanded_share": sum(v.get("expanded_share", 0.0) for v in train_events) / max(1, len(train_events)),
        "changes": paired_changes(Path(finished.run.output_dir), args.max_turns),
        "trackers": where_reported(finished.run.output_dir),
    }


def paired_changes(run_dir: Path, turns: int) -> dict[str, list[list[float]]]:
    """Per task set ("held_out", "train_tasks"), the change of pass@1 by each turn between the
    run's first and last evaluations, [change, standard error], from the per-task records the
    trainer writes (evals/): paired over tasks, so the error leaves out how hard each task is."""
    from leap.evaluation import paired_change

    records = sorted((run_dir / "evals").glob("step-*.json"))
    if len(records) < 2:
        return {}
    first, last = (json.loads(path.read_text())["pass_at_1_by_turn"] for path in (records[0], records[-1]))
    return {prefix.rstrip("/"): [list(paired_change(first[prefix], last[prefix], t)) for t in range(1, turns + 1)]
            for prefix in first if prefix in last}


def format_report(report: dict) -> str:
    turns = report["turns"]
    lines = [f"LEAP demo: {report['steps']} steps in {report['seconds'] / 60:.1f} min (run {report['run_id']})",
             "pass@1 ± its standard error over tasks; the change ± the standard error of the per-task changes",
             "", f"{'':34}{'before':>15}{'after':>15}{'change':>16}"]
    for label, key in (("held-out tasks (never trained on)", "held_out"),
                       ("training tasks, fresh samples", "train_tasks")):
        before, after = report[key]["before"], report[key]["after"]
        if not before:
            continue
        lines.append(f"{label}: {report.get('task_counts', {}).get(key, '?')} tasks")
        for t in range(1, turns + 1):
            name, se = f"pass_at_1/turn_{t}", f"pass_at_1_se/turn_{t}"
            changes = report.get("changes", {}).get(key)
            change, error = changes[t - 1] if changes else (after[name] - before[name], math.nan)
            lines.append(f"  pass@1 by turn {t:<17}{before[name]:>8.3f} ± {before.get(se, 0.0):.3f}"
                         f"{after[name]:>8.3f} ± {after.get(se, 0.0):.3f}{change:>+9.3f} ± {error:.3f}")
        name = f"pass_at_k/turn_{turns}"
        lines.append(f"  pass@k by turn {turns:<17}{before[name]:>8.3f}{'':7}{after[name]:>8.3f}{'':7}"
                     f"{after[name] - before[name]:>+9.3f}")
        if "speedup/mean_correct" in before and "speedup/mean_correct" in after:  # a timed run
            s0, s1 = before["speedup/mean_correct"], after["speedup/mean_correct"]
            lines.append(f"  mean speedup of correct answers {s0:>7.2f}x{'':7}{s1:>7.2f}x")
    lines += ["", f"sandbox evaluations spent by training: {report['sandbox_evaluations']:,.0f} "
                  f"(DCP saved up to {report['sandbox_evaluations_saved']:,.0f} against expanding every failing group)",
              f"groups expanded to debugging turns: {report['expanded_share']:.0%} on average",
              "", f"written to {report['output_dir']}:",
              "  metrics.png (curves), events.jsonl and tensorboard/ (every metric), rollouts/ (every answer and "
              "verdict), evals/ (each evaluation task by task), checkpoints/"]
    lines += [f"  reported to {where}" for where in report.get("trackers", [])]
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    text = format_report(report)
    say("\n" + text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.txt").write_text(text + "\n")
    say(f"  {out / 'report.txt'} and report.json (this summary)")
