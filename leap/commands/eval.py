"""`leap eval`: measure a model on a task set as the papers report it.

Every task of the selection gets `--samples` samples, each unsolved one debugged with the
sandbox's feedback up to `--turns` turns in all, and the command reports by turn: pass@1
(with its standard error over tasks), pass@k, KernelBench's fast_p for p in 0, 1, 1.5 and 2
(the share of samples correct with a speedup above p; a speedup the sandbox flagged never
counts as fast), and the geometric-mean speedup of correct answers. It prints a table and
writes eval.json and eval.png under --out.

The model and the tasks come from running services (`--policy`, `--sandbox`) or from a stack
this command starts: a policy serving `--model` (default: the bootstrapped tiny model) and a
sandbox serving the built-in suite plus `--task-dirs` (KernelBench-style directories, a
KernelBench checkout's level folders as they are, or JSONL/Parquet files of problems) and
`--task-families` (generated tasks, for example `rows:200`)."""

from __future__ import annotations

import json
from pathlib import Path

TOOLCHAINS = ("cpu", "cuda", "kernelbench")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="measure a model on a task set: pass@k, fast_p, speedup by turn",
                                   description=__doc__)
    where = parser.add_argument_group("the model")
    where.add_argument("--model", metavar="DIR", help="a Hugging Face model directory for the policy this command "
                                                      "starts (default: the bootstrapped tiny model)")
    where.add_argument("--policy", metavar="HOST:PORT", help="a running policy service to sample from instead")
    where.add_argument("--model-name", default="policy", help="the name the policy serves the model under "
                                                              "(default policy)")
    where.add_argument("--tokenizer", metavar="DIR", help="the model's tokenizer, with --policy (default: --model)")
    tasks = parser.add_argument_group("the tasks")
    tasks.add_argument("--sandbox", metavar="HOST:PORT", help="a running sandbox to judge with (and whose tasks to "
                                                              "choose from) instead of one this command starts")
    tasks.add_argument("--task-dirs", default="", help="for the sandbox this command starts: KernelBench-style "
                                                       "directories or JSONL/Parquet files, comma-separated")
    tasks.add_argument("--task-families", default="", help="for the sandbox this command starts: generated "
                                                           "families, NAME or NAME:COUNT, comma-separated")
    tasks.add_argument("--family-seed", type=int, default=0, help="seed of the generated tasks (default 0)")
    tasks.add_argument("--toolchain", choices=TOOLCHAINS, help="default: kernelbench with --task-dirs, else cuda "
                                                               "where a GPU and nvcc are present, else cpu")
    tasks.add_argument("--split", default="", choices=("", "train", "heldout"), help="only this split (default all)")
    tasks.add_argument("--family", default="", help="only generated tasks of this family")
    tasks.add_argument("--tier", type=int, default=0, help="only tasks of this tier, 1-3 (default all)")
    tasks.add_argument("--tasks", default="", help="exactly these task ids, comma-separated (instead of the filters)")
    tasks.add_argument("--limit", type=int, default=0, help="the first N tasks of the selection, by id (default all)")
    how = parser.add_argument_group("the measurement")
    how.add_argument("--samples", type=int, default=4, help="samples per task, k of pass@k (default 4)")
    how.add_argument("--turns", type=int, default=3, help="turns per sample, the first included (default 3)")
    how.add_argument("--max-new-tokens", type=int, default=384, help="tokens per answer (default 384)")
    how.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    how.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    parser.add_argument("--out", default="runs/eval", help="where eval.json and eval.png go (default runs/eval)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def check_args(args) -> None:
    from leap.cli import UserError

    for name in ("samples", "turns", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.limit < 0:
        raise UserError("--limit must not be negative")
    if not 0 <= args.tier <= 3:
        raise UserError("--tier: 0 (every tier) or 1 to 3")
    if not args.temperature > 0:
        raise UserError("--temperature must be above 0")
    if args.policy and not (args.tokenizer or args.model):
        raise UserError("--policy needs --tokenizer DIR (the served model's tokenizer) to build its prompts")
    if args.sandbox and (args.task_dirs or args.task_families):
        raise UserError("--task-dirs and --task-families configure the sandbox this command starts; with --sandbox, "
                        "set them on that service")
    if args.tasks and (args.split or args.family or args.tier):
        raise UserError("--tasks names the tasks: leave out --split, --family and --tier")
    for flag, path in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        if path:
            from leap.learning import check_model_dir

            if flag == "--model" and (problem := check_model_dir(path)):
                raise UserError(f"--model: {problem}")
            if not Path(path).is_dir():
                raise UserError(f"{flag}: {path} is not a directory")


def toolchain_of(args) -> int:
    from leap.commands.demo import demo_toolchain
    from leap.tasks import TOOLCHAIN_NAMES

    if args.toolchain:
        return TOOLCHAIN_NAMES[args.toolchain]
    return TOOLCHAIN_NAMES["kernelbench"] if args.task_dirs else demo_toolchain()


def run(args, _extra) -> int:
    from leap.cli import UserError
    from leap.commands.demo import bootstrap, say
    from leap.experiments.stack import experiment_stack

    check_args(args)
    out = Path(args.out)
    toolchain = toolchain_of(args)
    model = None
    if not args.policy:
        model = Path(args.model) if args.model else bootstrap(out / "model", toolchain, args.quiet)
    services = [name for name, given in (("policy", args.policy), ("sandbox", args.sandbox)) if not given]
    stack = None
    addresses = {"policy": args.policy, "sandbox": args.sandbox}
    if services:
        env = {"LEAP_SANDBOX_TASK_DIRS": args.task_dirs, "LEAP_SANDBOX_TASK_FAMILIES": args.task_families,
               "LEAP_SANDBOX_TASK_FAMILY_SEED": str(args.family_seed)}
        stack = experiment_stack(out / "stack", model or Path(args.tokenizer), services=services,
                                 model_name=args.model_name, extra_env=env)
        say(f"starting {' and '.join(services)} (logs in {out / 'stack' / 'logs'}) ...")
        try:
            stack.start()
        except (RuntimeError, TimeoutError) as err:
            raise UserError(f"{err} (see {out / 'stack' / 'logs'})") from None
        addresses.update(stack.addresses)
    try:
        summary = measure_selection(args, addresses, Path(args.tokenizer or model), toolchain)
    finally:
        if stack is not None:
            stack.stop()
    write_outputs(summary, out)
    return 0


def select_tasks(args, sandbox_address: str, toolchain: int) -> list:
    """The tasks to measure: --tasks, or what the sandbox lists under the filters."""
    import grpc

    from leap.cli import UserError
    from leap.experiments.measure import get_tasks, list_tasks

    try:
        if args.tasks:
            chosen = get_tasks(sandbox_address, [t.strip() for t in args.tasks.split(",") if t.strip()])
        else:
            chosen = list_tasks(sandbox_address, args.split, toolchain, family=args.family, tier=args.tier)
    except grpc.RpcError as err:
        raise UserError(f"the sandbox refused the selection: {err.details()}") from None
    unsupported = [t.id for t in chosen if toolchain not in t.toolchains]
    if unsupported:
        raise UserError(f"--toolchain: tasks {', '.join(unsupported[:5])} do not support it")
    chosen = sorted(chosen, key=lambda t: t.id)
    if args.limit:
        chosen = chosen[:args.limit]
    if not chosen:
        raise UserError("no task matches the selection (see --split, --family, --tier, --toolchain)")
    return chosen


def measure_selection(args, addresses: dict[str, str], tokenizer_dir: Path, toolchain: int) -> dict:
    from tqdm import tqdm

    from leap.commands.demo import say
    from leap.experiments.measure import measure
    from leap.union import toolchain_name

    tasks = select_tasks(args, addresses["sandbox"], toolchain)
    splits = {split: sum(t.split == split for t in tasks) for split in ("train", "heldout")}
    say(f"measuring {args.model_name} on {len(tasks)} tasks ({splits['train']} train, {splits['heldout']} held out; "
        f"{toolchain_name(toolchain)}), {args.samples} samples x up to {args.turns} turns each ...")
    with tqdm(total=len(tasks), desc="eval", unit="task", disable=args.quiet, dynamic_ncols=True) as bar:
        report = measure(addresses, args.model_name, tokenizer_dir, tasks, toolchain=toolchain, samples=args.samples,
                         turns=args.turns, seed=args.seed, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, on_task_done=lambda _task: bar.update(1))
    summary = report.summary()
    summary.update({"model": args.model_name, "toolchain": toolchain_name(toolchain), "seed": args.seed,
                    "splits": splits, "task_ids": [t.id for t in tasks]})
    return summary


def format_table(summary: dict) -> str:
    """The by-turn table: pass@1 +- its standard error, pass@k, fast_p."""
    ps = list(summary["fast_p"])
    head = ["turn", "pass@1", f"pass@{summary['samples'] // max(summary['tasks'], 1)}"] + [f"fast_{p}" for p in ps]
    rows = [head]
    for t in range(summary["turns"]):
        rows.append([str(t + 1), f"{summary['pass_at_1'][t]:.3f} +- {summary['pass_at_1_se'][t]:.3f}",
                     f"{summary['pass_at_k'][t]:.3f}"] + [f"{summary['fast_p'][p][t]:.3f}" for p in ps])
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    geomean = summary["geomean_speedup_of_correct"]
    lines.append(f"geometric-mean speedup of correct answers: {geomean:.3f}x" if geomean else
                 "geometric-mean speedup of correct answers: none correct and timed")
    lines.append(f"{summary['tasks']} tasks, {summary['samples']} samples, {summary['sandbox_evaluations']} sandbox "
                 f"evaluations; +- is the standard error over tasks")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = list(range(1, summary["turns"] + 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.errorbar(turns, summary["pass_at_1"], yerr=summary["pass_at_1_se"], marker="o", capsize=3, label="pass@1")
    left.plot(turns, summary["pass_at_k"], marker="s", label="pass@k")
    left.set(xlabel="turn", ylabel="share", title="correct by turn", xticks=turns, ylim=(0, 1.05))
    left.legend()
    for p, values in summary["fast_p"].items():
        right.plot(turns, values, marker="o", label=f"fast_{p}")
    right.set(xlabel="turn", ylabel="share of samples", title="fast_p by turn", xticks=turns, ylim=(0, 1.05))
    right.legend()
    fig.suptitle(f"{summary['model']} on {summary['tasks']} tasks ({summary['toolchain']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(summary: dict, out: Path) -> None:
    from leap.commands.demo import say

    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, out / "eval.png")
    say("\n" + format_table(summary))
    say(f"  {out / 'eval.json'} and {out / 'eval.png'}")
