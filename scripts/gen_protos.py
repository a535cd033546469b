#!/usr/bin/env python3
"""Regenerate the Python bindings of protos/ into leap/<service>/v1/, and
protos/service_config.json: the channel policy of `leap.clients` (retries of UNAVAILABLE with
backoff, round_robin) as a gRPC service config any client can load, written from
`leap.clients.channel.service_config()` so the two cannot drift.

Run it after editing any .proto file (or the policy) and commit the result;
tests/test_contracts.py fails when the committed files differ from a fresh generation.

    python scripts/gen_protos.py            # write the bindings
    python scripts/gen_protos.py --check    # exit 1 if they are stale (writes nothing)
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT_PACKAGE = "leap"  # protos/leap/x/v1/x.proto -> leap/x/v1/x_pb2.py
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
SERVICE_CONFIG = PROTOS / "service_config.json"


def service_config_text() -> str:
    """protos/service_config.json as it should be."""
    import json

    sys.path.insert(0, str(ROOT))
    from leap.clients.channel import service_config

    return json.dumps(json.loads(service_config()), indent=2) + "\n"


def proto_files() -> list[Path]:
    """Our contracts; protos/google/ holds googleapis' files, whose Python bindings come from
    the googleapis-common-protos package."""
    return sorted((PROTOS / OUT_PACKAGE).rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) with the grpc and mypy plugins into out_dir."""
    from grpc_tools import protoc
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(p) for p in proto_files()],
    ]
    # protoc looks up the mypy plugins on PATH; make sure this interpreter's scripts are there.
    import os

    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Make every generated directory an importable package.
    for directory in {p.parent for p in out_dir.rglob("*_pb2.py")}:
        d = directory
        while d != out_dir:
            (d / "__init__.py").touch(exist_ok=True)
            d = d.parent


def generated_files(base: Path) -> dict[str, Path]:
    """Relative path -> file, for every generated binding below base/leap."""
    found = {}
    for path in (base / OUT_PACKAGE).rglob("*"):
        if path.name.endswith(GENERATED_SUFFIXES):
            found[str(path.relative_to(base))] = path
    return found


def stale_files() -> list[str]:
    """Bindings that differ from, are missing from, or are extra to a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = Path(tmp)
        generate(fresh_dir)
        fresh, committed = generated_files(fresh_dir), generated_files(ROOT)
        stale = [rel for rel in fresh if rel not in committed or not filecmp.cmp(fresh[rel], committed[rel], shallow=False)]
        stale += [rel for rel in committed if rel not in fresh]
        return sorted(stale)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale bindings")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if not SERVICE_CONFIG.is_file() or SERVICE_CONFIG.read_text() != service_config_text():
            stale.append(str(SERVICE_CONFIG.relative_to(ROOT)))
        for rel in stale:
            print(f"stale: {rel}")
        if stale:
            print("run: python scripts/gen_protos.py")
        return 1 if stale else 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = Path(tmp)
        generate(fresh_dir)
        for rel in generated_files(ROOT):  # drop bindings of deleted protos
            if rel not in generated_files(fresh_dir):
                (ROOT / rel).unlink()
        for src in fresh_dir.rglob("*"):
            if src.is_file():
                dest = ROOT / src.relative_to(fresh_dir)
                dest.parent.mkdir(parents=True, exist_ok=True)
                if not (dest.name == "__init__.py" and dest.exists()):
                    shutil.copyfile(src, dest)
    SERVICE_CONFIG.write_text(service_config_text())
    print(f"generated bindings for {len(proto_files())} proto files, and {SERVICE_CONFIG.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
