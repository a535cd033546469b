"""Conformance of a DistillService: the run RPCs (runs.py)."""

from leap.conformance.runs import run_suite
from leap.distill.v1 import distill_pb2

SUITE = run_suite("distill", distill_pb2, "DistillService")
