"""Conformance of a TrainerService: the run RPCs (runs.py), and GetTeacherUnion's lookup (an
RGRPO run to read a union from cannot be started read-only)."""

from leap.conformance.runs import run_suite
from leap.trainer.v1 import trainer_pb2

SUITE = run_suite("trainer", trainer_pb2, "TrainerService")
SUITE.add_lookup("GetTeacherUnion", trainer_pb2.GetTeacherUnionRequest, "run_id", "run")
