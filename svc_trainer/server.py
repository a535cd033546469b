"""The TrainerService servicer: a thin layer between the contract and the algorithms.

The run RPCs come from `leap.learning.RunApi` over a `RunRegistry`; this module adds the
trainer's config checks (config.py, preflight.py) and its job (job.py: the LEAP loop).
GetTeacherUnion reads the union an RGRPO run writes into its output directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from leap.learning.registry import RunRecord
from leap.learning.run_api import RunApi, RunServiceConfig
from leap.runtime import Registration, Service, ServiceSpec, local_address, option
from leap.runtime import failed_precondition
from leap.union import UNION_FILE, TeacherUnion
from leap.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from svc_trainer import config as run_config
from svc_trainer.job import UNION_DIR, JobSettings, TrainingJob
from svc_trainer.preflight import preflight

SERVICE_NAME = "leap.trainer.v1.TrainerService"
ROLLOUT_LOGS = ("off", "text", "tokens")


@dataclasses.dataclass
class TrainerConfig(RunServiceConfig):
    """Settings of the trainer service (run-service and server settings included)."""

    runs_dir: str = option("runs/trainer", "Directory of the runs: one folder per run with its record, metrics, "
                           "TensorBoard events, plots and checkpoints (unless a run names its own output_dir).")
    policy_address: str = option(local_address("policy"), "PolicyService target of runs that leave services.policy empty.")
    sandbox_address: str = option(local_address("sandbox"), "SandboxService target of runs that leave services.sandbox empty.")
    reward_address: str = option(local_address("reward"), "RewardService target of runs that leave services.reward empty.")
    rollout_log: str = option("text", "Per step, write every trajectory to rollouts/step-N.jsonl in the run's directory: "
                              "off, text (answers, verdicts, rewards) or tokens (also token ids and sampler logprobs).")
    no_signal_warning_steps: int = option(3, "Emit a `warning` event (and log it) when every group's rewards tied for "
                                          "this many steps in a row (reward/zero_spread_share 1: nothing to learn "
                                          "from); 0 turns the warning off. The run carries on either way.")

    def __post_init__(self) -> None:
        # Checked when the settings are loaded, so a bad value stops `leap serve` with one line.
        super().__post_init__()
        if self.rollout_log not in ROLLOUT_LOGS:
            raise ValueError(f"rollout_log: must be one of {', '.join(ROLLOUT_LOGS)}, got {self.rollout_log!r}")


class TrainerServicer(RunApi, trainer_pb2_grpc.TrainerServiceServicer):
    """The GRPO learner, the LEAP loop and RGRPO teacher rounds, as runs."""

    messages = trainer_pb2

    def __init__(self, settings: TrainerConfig):
        self.settings = settings
        self.registry = self.make_registry(settings)

    def default_services(self) -> trainer_pb2.ServiceAddresses:
        s = self.settings
        return trainer_pb2.ServiceAddresses(policy=s.policy_address, sandbox=s.sandbox_address, reward=s.reward_address)

    async def prepare_config(self, config: trainer_pb2.RunConfig) -> tuple[trainer_pb2.RunConfig, int]:
        found = run_config.violations(config)  # reported with what the services say, in one error
        filled = run_config.with_defaults(config, self.default_services())
        filled = await preflight(filled, timeout=self.settings.preflight_timeout_seconds, v=found)
        return filled, run_config.total_steps(filled)

    async def GetTeacherUnion(self, request, context):
        record = self._get(request.run_id)
        config = self.config_of(record)
        if not config.rgrpo.rounds:
            raise failed_precondition(f"run {record.run_id} is a plain run (rgrpo.rounds = 0): it builds no teacher union",
                                      "NOT_AN_RGRPO_RUN")
        directory = Path(record.output_dir) / UNION_DIR
        if not (directory / UNION_FILE).is_file():  # no round finished yet: the union has no teacher
            union = trainer_pb2.TeacherUnion(path=str(directory), task_ids=config.train_tasks, run_id=record.run_id,
                                             samples_per_task=config.rgrpo.eval_samples, tau=config.rgrpo.tau)
        else:
            try:
                union = (await asyncio.to_thread(TeacherUnion.read, directory)).to_proto()
            except ValueError as err:  # for example a teacher directory removed by hand
                raise failed_precondition(str(err), "UNION_UNREADABLE") from None
        return trainer_pb2.GetTeacherUnionResponse(union=union)

    def make_job(self, record: RunRecord) -> TrainingJob:
        s = self.settings
        return TrainingJob(self.config_of(record), JobSettings(device=s.device, service_retry_seconds=s.service_retry_seconds,
                                                               keep_checkpoints=s.keep_checkpoints,
                                                               rollout_log=s.rollout_log,
                                                               weight_transport=s.weight_transport,
                                                               no_signal_warning_steps=s.no_signal_warning_steps))


def build(config: TrainerConfig) -> Service:
    servicer = TrainerServicer(config)
    return Service(
        name="trainer",
        registrations=[Registration(SERVICE_NAME, trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer)],
        on_start=servicer.start,
        on_stop=servicer.stop,
    )


SPEC = ServiceSpec(name="trainer", config_class=TrainerConfig, build=build, description="The GRPO learner, the LEAP loop and RGRPO teacher rounds, as runs.")
