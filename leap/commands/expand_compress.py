"""`leap expand-compress`: expand-then-compress on this machine. RGRPO trains R teachers from
the same initial weights, each later round redirected toward the training tasks the union
does not cover yet; TU-OPD then distils the union into one student, on the student's own
samples, once per ablation (CRD, plain consensus, no reliability gating, no quality
weighting, single best teacher). Every model — the initial one, each teacher, each student
— is then measured by one evaluator with one seed on fresh samples of the training tasks and
on the held-out tasks, and the command writes a table and a plot.

The tasks are `leap demo`'s (`--task-families`, default the elementwise family's tier 1): RGRPO
trains on, the union covers and the measurement samples the first `--train-tasks` training
tasks (default 64; each teacher's quality row measures every one of them), and every model is
measured on the held-out split too; `--task-families none` runs on the built-in suite.

The seed paper reports the student beating its strongest teacher by 2.0%, 8.3% and 6.9%
(relative) on math, code and instruction following; this command reports what this machine
gives, whichever way it goes. The whole experiment runs once per seed (`--seeds`, default 3,
each on a fresh stack under OUT/seed-N); the top report gives every pass@1 as mean ± standard
error over the seeds and says on how many seeds each student beat its strongest teacher. A seed
that finished before in the same --out with the same settings and model is read back rather
than run again."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ABLATIONS = {
    "crd": {},
    "consensus": {"objective": "OBJECTIVE_CONSENSUS"},
    "no-gating": {"disable_reliability_gating": True},
    "no-weighting": {"disable_quality_weighting": True},
    "single-best": {"single_best_teacher": True},
}


def add_parser(subparsers) -> None:
    from leap.commands.demo import add_speed_rank_option, add_task_families_option

    parser = subparsers.add_parser("expand-compress", help="RGRPO teachers, then TU-OPD students, measured",
                                   description=__doc__)
    parser.add_argument("--out", default="runs/expand-compress", help="output directory (default runs/expand-compress)")
    parser.add_argument("--model", metavar="DIR", help="initial model directory (default: the bootstrapped tiny model)")
    parser.add_argument("--rounds", type=int, default=2, help="RGRPO rounds, R (default 2)")
    parser.add_argument("--steps-per-round", type=int, default=10, help="LEAP steps per round (default 10)")
    parser.add_argument("--distill-steps", type=int, default=10, help="TU-OPD steps per student (default 10)")
    parser.add_argument("--ablations", default=",".join(ABLATIONS),
                        help=f"comma-separated students to distil, from {', '.join(ABLATIONS)} (default all)")
    parser.add_argument("--tasks-per-step", type=int, default=8, help="tasks per step of both stages (default 8)")
    parser.add_argument("--group-size", type=int, default=8, help="RGRPO rollouts per task, G (default 8)")
    parser.add_argument("--max-turns", type=int, default=3, help="RGRPO turns for expanded groups, K (default 3)")
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="AdamW learning rate of both stages (default 5e-4)")
    parser.add_argument("--reliability-threshold", type=float, metavar="RHO",
                        help="TU-OPD's rho: a teacher counts on a task where its pass rate is at least this "
                             "(default: the distiller's, 0.5); where no teacher reaches it on any training task the "
                             "gated students cannot be distilled")
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per task for q and for the final "
                                                                   "measurement (default 8)")
    parser.add_argument("--train-tasks", type=int, default=64, help="training tasks (the first by id) RGRPO trains "
                                                                   "on, the union covers and the measurement samples "
                                                                   "(default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of everything (default 0)")
    add_task_families_option(parser)
    add_speed_rank_option(parser)
    parser.add_argument("--seeds", type=int, default=3, help="seeds to repeat the whole experiment with: --seed, "
                                                             "--seed + 1, ... (default 3); the report gives each "
                                                             "pass@1's mean and standard error over them")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def check_args(args) -> list[str]:
    from leap.cli import UserError
    from leap.commands.demo import experiment_tasks, split_ids

    for name in ("rounds", "steps_per_round", "distill_steps", "tasks_per_step", "max_turns", "eval_samples", "seeds",
                 "train_tasks"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    args.tasks = experiment_tasks(args.task_families)
    train_ids, args.held_out_ids = split_ids(args.tasks)
    args.train_ids = train_ids[:args.train_tasks]
    if args.reliability_threshold is not None and not 0 <= args.reliability_threshold <= 1:
        raise UserError(f"--reliability-threshold must be in [0, 1], not {args.reliability_threshold:g}")
    if args.group_size < 2:
        raise UserError("--group-size must be at least 2: rank rewards compare rollouts within a group")
    ablations = [a.strip() for a in args.ablations.split(",") if a.strip()]
    if not ablations or any(a not in ABLATIONS for a in ablations):
        raise UserError(f"--ablations: choose from {', '.join(ABLATIONS)}, not {args.ablations!r}")
    return ablations


def run(args, _extra) -> int:
    from leap.cli import UserError
    from leap.commands.demo import bootstrap, demo_toolchain, families_env, say
    from leap.experiments.compare import seed_dir
    from leap.experiments.resume import finished, save_finished
    from leap.experiments.runs import RunFailed
    from leap.experiments.stack import experiment_stack

    ablations = check_args(args)
    out = Path(args.out)
    toolchain = demo_toolchain()
    model = (Path(args.model) if args.model else bootstrap(out / "model", toolchain, args.tasks, args.quiet)).resolve()
    seeds = [args.seed + number for number in range(args.seeds)]
    per_seed = []
    for seed in seeds:
        work, this = seed_dir(out, seed, len(seeds)), argparse.Namespace(**{**vars(args), "seed": seed})
        record, stamp = work / "finished.json", seed_stamp(this, ablations, model)
        results = finished(record, stamp, "results")
        if results is not None:
            say(f"\n== seed {seed}: finished before with these settings; its results are read back from {record} "
                "(delete the directory to run it again)")
        else:
            say(f"\n== seed {seed}: starting the services (logs in {work / 'stack' / 'logs'}) ...")
            try:
                with experiment_stack(work / "stack", model, extra_env=families_env(args.task_families)) as stack:
                    union = train_teachers(this, stack.addresses, model, toolchain)
                    students = {name: distil(this, stack.addresses, model, toolchain, union, name)
                                for name in ablations}
                    results = measure_all(this, stack.addresses, model, toolchain, union, students)
            except (RunFailed, RuntimeError, TimeoutError) as err:
                hint = ("; lower --reliability-threshold, or train the teachers longer (--steps-per-round)"
                        if "config.reliability_threshold" in getattr(err, "fields", ()) else "")
                raise UserError(f"seed {seed}: {err}{hint}") from None
            save_finished(record, stamp, "results", results)
        report(this, results, work)
        per_seed.append(results)
    if len(seeds) > 1:
        report_seeds(args, seeds, per_seed, out)
    return 0


SETTINGS = ("rounds", "steps_per_round", "distill_steps", "tasks_per_step", "group_size", "max_turns", "learning_rate",
            "reliability_threshold", "eval_samples", "train_tasks", "task_families", "speed_rank", "seed")


def seed_stamp(args, ablations: list[str], model: Path) -> dict:
    """What decides one seed's results: the settings, the students and the initial model."""
    from leap.experiments.resume import model_stamp

    return {"settings": {name: getattr(args, name) for name in SETTINGS}, "ablations": ablations,
            "model": model_stamp(model)}


def rgrpo_config(args, model: Path, toolchain: int):
    """The RGRPO run's RunConfig: LEAP steps in R rounds on the training tasks, speed ranked or
    not as `--speed-rank` says (off, the cpu default, its sandbox verdicts are untimed)."""
    from leap.commands.demo import speed_fields
    from leap.common.v1 import common_pb2
    from leap.trainer.v1 import trainer_pb2

    return trainer_pb2.RunConfig(
        model_path=str(model), steps=args.steps_per_round, tasks_per_step=args.tasks_per_step,
        group_size=args.group_size, max_turns=args.max_turns, toolchain=toolchain, seed=args.seed,
        train_tasks=args.train_ids, eval_tasks=args.held_out_ids,
        eval_samples=args.eval_samples, checkpoint_every=args.steps_per_round, display_name="expand: RGRPO",
        optimizer=common_pb2.OptimizerConfig(learning_rate=args.learning_rate),
        rgrpo=trainer_pb2.RgrpoConfig(rounds=args.rounds, steps_per_round=args.steps_per_round,
                                      eval_samples=args.eval_samples),
        **speed_fields(args.speed_rank, toolchain))


def train_teachers(args, addresses: dict[str, str], model: Path, toolchain: int):
    """The RGRPO run; its teacher union (as the contract's message)."""
    from leap.clients import connect
    from leap.commands.demo import say
    from leap.experiments.runs import run_to_end
    from leap.trainer.v1 import trainer_pb2

    config = rgrpo_config(args, model, toolchain)
    trainer = connect("trainer", addresses["trainer"], aio=False)
    try:
        finished = run_to_end(trainer, trainer_pb2, config, "RGRPO", progress=not args.quiet,
                              postfix_keys=("pass_at_1/turn_1", "expanded_share"))
        union = trainer.GetTeacherUnion(trainer_pb2.GetTeacherUnionRequest(run_id=finished.run.run_id)).union
    finally:
        trainer.channel.close()
    say(f"teacher union: {len(union.teachers)} teachers, coverage of the training tasks by round "
        + ", ".join(f"{c:.2f}" for c in union.coverage_by_round) + f" (tau {union.tau:g}); {union.path}")
    return union


def distill_config(args, model: Path, toolchain: int, union_path: str, ablation: str):
    """One TU-OPD student's DistillConfig: from the initial weights, on the union, with the
    ablation's switches and `--reliability-threshold` where given."""
    from leap.common.v1 import common_pb2
    from leap.distill.v1 import distill_pb2

    switches = dict(ABLATIONS[ablation])
    if "objective" in switches:
        switches["objective"] = distill_pb2.Objective.Value(switches["objective"])
    config = distill_pb2.DistillConfig(
        student_model_path=str(model), student_model=f"student-{ablation}", teacher_union_path=union_path,
        toolchain=toolchain, steps=args.distill_steps, examples_per_step=args.tasks_per_step, seed=args.seed,
        eval_samples=args.eval_samples, checkpoint_every=args.distill_steps, display_name=f"compress: {ablation}",
        optimizer=common_pb2.OptimizerConfig(learning_rate=args.learning_rate), **switches)
    if args.reliability_threshold is not None:
        config.reliability_threshold = args.reliability_threshold
    return config


def distil(args, addresses: dict[str, str], model: Path, toolchain: int, union, ablation: str) -> str:
    """One TU-OPD run from the initial weights; the name its student is served under."""
    from leap.clients import connect
    from leap.distill.v1 import distill_pb2
    from leap.experiments.runs import run_to_end

    config = distill_config(args, model, toolchain, union.path, ablation)
    distiller = connect("distill", addresses["distill"], aio=False)
    try:
        run_to_end(distiller, distill_pb2, config, f"TU-OPD {ablation}", progress=not args.quiet,
                   postfix_keys=("loss", "kl/target"))
    finally:
        distiller.channel.close()
    return config.student_model


TASK_SETS = {"train": "training tasks (fresh samples)", "heldout": "held-out tasks"}


def measure_all(args, addresses: dict[str, str], model: Path, toolchain: int, union, students: dict[str, str]) -> dict:
    """pass@1 (first turn) of every model on fresh samples of the training tasks and on the
    held-out tasks, by one evaluator with one seed per task set; the teachers' per-task pass
    rates give the union's best-of-teachers pass@1 and coverage on each set."""
    from leap.clients import connect
    from leap.commands.demo import say
    from leap.experiments.measure import get_tasks, measure
    from leap.policy.v1 import policy_pb2
    from leap.rollouts import derive_seed

    policy = connect("policy", addresses["policy"], aio=False)
    served = {m.name for m in policy.ListModels(policy_pb2.ListModelsRequest()).models}
    for name, path in [("initial", str(model)), *[(t.name, t.model_path) for t in union.teachers]]:
        if name not in served:
            policy.LoadModel(policy_pb2.LoadModelRequest(name=name, path=path), timeout=600)
    policy.channel.close()
    models = ["initial", *[t.name for t in union.teachers], *students.values()]
    results: dict = {"teachers": [t.name for t in union.teachers], "students": students, "tau": union.tau,
                     "train_coverage_by_round": list(union.coverage_by_round), "union_path": union.path, "sets": {}}
    for split, label in TASK_SETS.items():
        tasks = get_tasks(addresses["sandbox"], args.train_ids if split == "train" else args.held_out_ids)
        say(f"measuring {len(models)} models on the {len(tasks)} {label} ({args.eval_samples} samples each) ...")
        seed = derive_seed(args.seed, "expand-compress", split)
        # pass@1 alone is reported: the sandbox is not asked to time anything
        reports = {name: measure(addresses, name, model, tasks, toolchain=toolchain, samples=args.eval_samples, turns=1,
                                 seed=seed, timing=False) for name in models}
        best = {t.id: max(reports[name].pass_rates()[t.id] for name in results["teachers"]) for t in tasks}
        results["sets"][split] = {
            "pass_at_1": {name: r.metrics()["pass_at_1/turn_1"] for name, r in reports.items()},
            "best_of_union": sum(best.values()) / max(1, len(best)),
            "coverage": sum(q >= union.tau for q in best.values()) / max(1, len(best)),
            "per_task": {name: r.pass_rates() for name, r in reports.items()},
        }
    return results


def report(args, results: dict, out: Path) -> None:
    """One seed's table (each pass@1 with its standard error over tasks), plot and claims."""
    from leap.commands.demo import say
    from leap.evaluation import standard_error

    lines = [f"# Expand then compress: R={args.rounds} rounds x {args.steps_per_round} RGRPO steps, "
             f"{args.distill_steps} TU-OPD steps per student, seed {args.seed}", ""]
    header, rule = "| model |", "|---|"
    for split in TASK_SETS:
        header += f" {split} pass@1 | vs strongest teacher |"
        rule += "---|---|"
    lines += [header, rule]
    strongest = {split: max(results["teachers"], key=lambda t: results["sets"][split]["pass_at_1"][t])
                 for split in TASK_SETS}
    for name in results["sets"]["train"]["pass_at_1"]:
        row = f"| {name} |"
        for split in TASK_SETS:
            rates = results["sets"][split]["pass_at_1"]
            top = rates[strongest[split]]
            error = standard_error(list(results["sets"][split]["per_task"][name].values()))
            cell = f" {rates[name]:.3f} ± {error:.3f} |"
            row += cell + (f" {(rates[name] - top) / top:+.1%} |" if top > 0 else " n/a |")
        lines.append(row)
    lines.append("")
    lines.append("Union (tau {:g}): coverage of the training tasks after each round {} (RGRPO's own measurement); "
                 "best-of-teachers pass@1 {}.".format(
                     results["tau"], ", ".join(f"{c:.2f}" for c in results["train_coverage_by_round"]),
                     ", ".join(f"{split} {results['sets'][split]['best_of_union']:.3f} "
                               f"(coverage {results['sets'][split]['coverage']:.2f})" for split in TASK_SETS)))
    crd = results["students"].get("crd")
    for split, label in TASK_SETS.items():
        rates = results["sets"][split]["pass_at_1"]
        top = rates[strongest[split]]
        if crd and top > 0:
            gain = (rates[crd] - top) / top
            verdict = "beats" if gain > 0 else ("matches" if gain == 0 else "trails")
            lines.append(f"On the {label} the CRD student {verdict} its strongest teacher ({strongest[split]}): "
                         f"{gain:+.1%} relative (paper: +2.0% math, +8.3% code, +6.9% instruction following).")
    plot = plot_bars({split: results["sets"][split]["pass_at_1"] for split in TASK_SETS}, out / "expand_compress.png")
    lines += ["", f"plot: {plot}"]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text + "\n")
    (out / "report.json").write_text(json.dumps(results, indent=2) + "\n")
    say("\n" + text + f"\nreport: {out / 'report.md'}")


def report_seeds(args, seeds: list[int], per_seed: list[dict], out: Path) -> None:
    """Every model's pass@1 as mean ± standard error over the seeds, and on how many seeds each
    student beat its strongest teacher."""
    from leap.commands.demo import say
    from leap.experiments import compare

    names = list(per_seed[0]["sets"]["train"]["pass_at_1"])
    # Teachers are named by round (teacher-1, ...) in every seed, so rows line up across seeds.
    lines = [f"# Expand then compress over seeds {', '.join(map(str, seeds))}: R={args.rounds} rounds x "
             f"{args.steps_per_round} RGRPO steps, {args.distill_steps} TU-OPD steps per student", "",
             "| model | " + " | ".join(f"{split} pass@1" for split in TASK_SETS) + " |",
             "|---|" + "---|" * len(TASK_SETS)]
    spreads = {name: {split: compare.spread([r["sets"][split]["pass_at_1"].get(name, float("nan")) for r in per_seed])
                      for split in TASK_SETS} for name in names}
    lines += [f"| {name} | " + " | ".join(str(spreads[name][split]) for split in TASK_SETS) + " |" for name in names]
    lines += ["", f"(mean ± standard error over {len(seeds)} seeds)", "", "The paper's claim, seed by seed:"]
    claims = [compare.student_claim([r["sets"][split]["pass_at_1"] for r in per_seed],
                                    [r["teachers"] for r in per_seed], student, label)
              for student in per_seed[0]["students"].values() for split, label in TASK_SETS.items()]
    lines += claims
    plot = plot_bars({split: {name: spreads[name][split].mean for name in names} for split in TASK_SETS},
                     out / "expand_compress.png",
                     errors={split: {name: spreads[name][split].se for name in names} for split in TASK_SETS},
                     title=f"mean and standard error over {len(seeds)} seeds")
    lines += ["", f"plot: {plot}", "each seed's table, plot and runs: "
              + ", ".join(str(compare.seed_dir(out, s, len(seeds))) for s in seeds)]
    text = "\n".join(lines)
    (out / "report.md").write_text(text + "\n")
    (out / "report.json").write_text(json.dumps({
        "seeds": seeds, "pass_at_1": {name: {split: value.to_json() for split, value in figures.items()}
                                      for name, figures in spreads.items()}, "claims": claims}, indent=2) + "\n")
    say("\n" + text + f"\nreport: {out / 'report.md'}")


def plot_bars(rates_by_set: dict[str, dict[str, float]], path: Path,
              errors: dict[str, dict[str, float]] | None = None, title: str = "") -> Path:
    """One panel per task set: a bar per model (grey: initial, blue: teachers, orange: students),
    with `errors` (a standard error per bar, over seeds) drawn as error bars where given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from leap.learning.metrics import save_figure

    count = len(next(iter(rates_by_set.values())))
    figure, axes = plt.subplots(1, len(rates_by_set), figsize=(1 + 0.75 * count * len(rates_by_set), 4), squeeze=False)
    for axis, (split, rates) in zip(axes[0], rates_by_set.items()):
        colors = ["#999999" if n == "initial" else "#4c72b0" if n.startswith("teacher") else "#dd8452" for n in rates]
        # nan: a model only one seed measured has no spread to draw
        spreads = [0.0 if not errors or math.isnan(errors[split][n]) else errors[split][n] for n in rates]
        axis.bar(list(rates), list(rates.values()), color=colors, yerr=spreads if errors else None,
                 capsize=3 if errors else 0)
        axis.set_title(TASK_SETS[split])
        axis.set_ylabel("pass@1")
        top = max(rate + spread for rate, spread in zip(rates.values(), spreads))
        axis.set_ylim(0, max(0.05, 1.15 * top))  # all-zero bars still show a 0-based axis
        axis.tick_params(axis="x", rotation=35)
        axis.grid(axis="y", alpha=0.3)
    caption = "initial model, RGRPO teachers, TU-OPD students" + (f": {title}" if title else "")
    return save_figure(figure, path, caption)
