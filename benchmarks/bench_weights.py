#!/usr/bin/env python3
"""Weight pushes by every transport, against memcpy of the same bytes, in one run:

- grpc: the UpdateWeights stream (chunks of 4 MiB with CRC-32s) over loopback;
- shm: a POSIX shared-memory object written by the learner, CommitWeights carrying the name;
- gloo: a torch.distributed group (gloo, loopback TCP) opened once, tensors sent point to point;
- memcpy: one copy of every tensor into a preallocated buffer of the same size.

It also prints the two checksums' rates on one thread, on 256 KiB in cache (CRC-32 through
ISA-L, the stream's and gloo's; CRC-32C through crc32c, shared memory's where offered).

One randomly initialized Qwen2 model of --weights-mb MB (float32, built here: nothing is
downloaded) is served by a real `leap serve policy` process; this process is the learner.
Each transport is warmed (--warm pushes), then timed over --repeats pushes, alternating the
transports round by round so that load on a shared machine hits them alike; a figure is
the median GB/s (bytes pushed / seconds from the call to the new version serving), with the
spread. Targets (DESIGN.md): shm at least 0.5 of memcpy and 4x grpc; gloo at least 2x grpc.

    .venv/bin/python benchmarks/bench_weights.py --json runs/bench_weights.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_policy import big_model  # noqa: E402
from leap.clients import connect  # noqa: E402
from leap.clients.transports import WeightPusher  # noqa: E402
from leap.clients.weights import keep_freed_memory  # noqa: E402
from tests.conftest import leap_serve  # noqa: E402

TRANSPORTS = {"grpc": "stream", "shm": "shm", "gloo": "distributed"}


def memcpy_seconds(state: dict[str, torch.Tensor]) -> float:
    """One copy of every tensor's bytes into a buffer allocated (and touched) beforehand."""
    sources = [t.reshape(-1).view(torch.uint8).numpy() for t in state.values()]
    targets = [np.ones_like(s) for s in sources]
    start = time.perf_counter()
    for source, target in zip(sources, targets):
        np.copyto(target, source)
    return time.perf_counter() - start


def checksum_rates(block: int = 256 * 1024, rounds: int = 2000) -> dict[str, float]:
    """GB/s of each checksum on one thread, over one buffer that stays in cache."""
    from leap.clients.checksums import crc32c
    from leap.clients.weights import crc32

    data = np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8)
    rates = {}
    for name, checksum in (("crc32", crc32), ("crc32c", crc32c)):
        start = time.perf_counter()
        for _ in range(rounds):
            checksum(data)
        rates[name] = block * rounds / (time.perf_counter() - start) / 1e9
    return rates


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} GB/s (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


async def measure(address: str, state: dict[str, torch.Tensor], names: list[str], warm: int, repeats: int) -> dict:
    nbytes = sum(t.nbytes for t in state.values())
    stub = connect("policy", address, stream_deadline=600, unary_deadline=600)
    pushers = {name: WeightPusher(stub, "policy", TRANSPORTS[name], timeout=600) for name in names}
    rates: dict[str, list[float]] = {name: [] for name in [*names, "memcpy"]}
    version = 0
    try:
        for round_ in range(warm + repeats):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                version += 1
                start = time.perf_counter()
                result = await pushers[name].push(version, state)
                seconds = time.perf_counter() - start
                assert result.transport == TRANSPORTS[name] and result.bytes == nbytes, result
                if round_ >= warm:
                    rates[name].append(nbytes / seconds / 1e9)
            seconds = await asyncio.to_thread(memcpy_seconds, state)
            if round_ >= warm:
                rates["memcpy"].append(nbytes / seconds / 1e9)
    finally:
        for pusher in pushers.values():
            await pusher.close()
        await stub.channel.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights-mb", type=int, default=550, help="size of the model's float32 weights")
    parser.add_argument("--warm", type=int, default=2, help="untimed pushes per transport first")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transports", default="grpc,shm,gloo")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args()
    names = [n for n in args.transports.split(",") if n]
    keep_freed_memory()  # as the policy service does at start
    with tempfile.TemporaryDirectory() as work:
        directory = big_model(Path(work) / "big", args.weights_mb)
        from safetensors.torch import load_file

        state = load_file(str(directory / "model.safetensors"))
        nbytes = sum(t.nbytes for t in state.values())
        print(f"{nbytes / 1e6:.0f} MB in {len(state)} tensors; torch threads {torch.get_num_threads()}; the machine "
              f"may be shared: figures are ratios measured in one run", flush=True)
        with leap_serve("policy", "--models", f"policy={directory}", "--drain-seconds", "0", timeout=300) as (address, _):
            rates = asyncio.run(measure(address, state, names, args.warm, args.repeats))
    median = {name: statistics.median(values) for name, values in rates.items()}
    for name in [*names, "memcpy"]:
        print(f"{name:>7}: {spread(rates[name])}")
    memcpy = median["memcpy"]
    checksums = checksum_rates()
    print("checksums on one thread, in cache: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in checksums.items()))
    if "shm" in median:
        print(f"shm / memcpy = {median['shm'] / memcpy:.2f} (target >= 0.5)")
    if "grpc" in median:
        for name in ("shm", "gloo"):
            if name in median:
                target = 4 if name == "shm" else 2
                print(f"{name} / grpc = {median[name] / median['grpc']:.1f}x (target >= {target}x)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "transport": {name: median[name] for name in names}, "memcpy_GBps": memcpy,
            "samples_GBps": rates, "bytes": nbytes, "checksum_GBps": checksums}, indent=1))


if __name__ == "__main__":
    main()
