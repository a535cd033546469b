"""Conformance of a TrainerService: the run RPCs (runs.py). GetTeacherUnion is only probed
for existence: an RGRPO run to read a union from cannot be started read-only."""

from leap.conformance.runs import run_suite
from leap.trainer.v1 import trainer_pb2

SUITE = run_suite("trainer", trainer_pb2, "TrainerService")
