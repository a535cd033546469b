"""LEAP suite: the shared package of every service.

- `leap.<service>.v1`: generated protobuf and gRPC bindings of the contracts in protos/.
- `leap.runtime`: the gRPC server runtime (health, reflection, logging, errors, auth, TLS).
- `leap.clients`: channel and stub helpers for calling any service.
- `leap.cli`: the `leap` command.
"""

import os

__version__ = "0.1.0"

# OpenMP threads that sleep when idle instead of spinning. Torch's CPU build runs every op's
# parallel region on libgomp's threads, which by default spin for about 3 ms after each region
# (ACTIVE: for minutes) waiting for the next one. A service's learner or sampler shares its
# cores with gRPC's threads, the event loop, the policy's sampling and the sandbox's compiles:
# the spinning threads hold the cores the thread doing the work needs. On 2 busy cores one
# learner step of the tiny model beside one CPU-bound process took 0.74 s with PASSIVE, 1.21 s
# with ACTIVE and 1.35 s with libgomp's default (benchmarks/bench_learner_threads.py). libgomp
# reads the variable once, when torch loads it: this package is imported before torch by every
# entry point (`leap`, `python -m leap`, the services, the learner ranks), so it is set here,
# and only where the user has not chosen a policy of their own.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
