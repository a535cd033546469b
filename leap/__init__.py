"""LEAP suite: the shared package of every service.

- `leap.<service>.v1`: generated protobuf and gRPC bindings of the contracts in protos/.
- `leap.runtime`: the gRPC server runtime (health, reflection, logging, errors, auth, TLS).
- `leap.clients`: channel and stub helpers for calling any service.
- `leap.cli`: the `leap` command.
"""

__version__ = "0.1.0"
