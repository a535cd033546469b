"""Starting a run on a learner service and following it with a progress bar, then reading
its metric events (the same for the trainer and the distiller: both keep the run contract)."""

from __future__ import annotations

import dataclasses
import uuid
from types import ModuleType

from leap.common.v1 import common_pb2

RunState = common_pb2.RunState
TRAIN_TASKS = "train_tasks/"  # the prefix of the training tasks' evaluation metrics
TERMINAL = (RunState.RUN_STATE_STOPPED, RunState.RUN_STATE_SUCCEEDED, RunState.RUN_STATE_FAILED)


class RunFailed(RuntimeError):
    """A run ended in another state than SUCCEEDED, or the service refused or lost it (then
    `fields` are the config fields its BadRequest names)."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.fields = fields


@dataclasses.dataclass
class FinishedRun:
    """A run that succeeded, with every event it recorded."""

    run: object  # the contract's Run message
    events: list[common_pb2.MetricEvent]

    def of_kind(self, kind: str) -> list[common_pb2.MetricEvent]:
        return [e for e in self.events if e.kind == kind]

    def evaluations(self, prefix: str = "") -> list[dict[str, float]]:
        """The values of every evaluation of a task set (held-out: prefix ""; the training
        tasks: "train_tasks/"), in order, with the prefix removed."""
        found = []
        for event in self.of_kind("eval"):
            if prefix + "pass_at_1/turn_1" in event.values:
                found.append({k[len(prefix):]: v for k, v in event.values.items()
                              if k.startswith(prefix) and (prefix or not k.startswith(TRAIN_TASKS))})
        return found


def run_to_end(stub, messages: ModuleType, config, label: str, progress: bool = True,
               postfix_keys: tuple[str, ...] = ()) -> FinishedRun:
    """Start a run of `config` on `stub` (a blocking stub of the trainer or the distiller),
    show a progress bar of its steps until it ends, and return it; RunFailed when it did not
    succeed, was refused (the service's reason, naming the config field) or the service went away."""
    import grpc

    from leap.runtime.errors import call_failure, violated_fields

    try:
        return _follow(stub, messages, config, label, progress, postfix_keys)
    except grpc.RpcError as err:
        failure = call_failure(err)
        if failure is None:
            raise
        raise RunFailed(f"{label}: {failure}", tuple(violated_fields(err))) from None


def _follow(stub, messages: ModuleType, config, label: str, progress: bool, postfix_keys: tuple[str, ...]) -> FinishedRun:
    from tqdm import tqdm

    run = stub.StartRun(messages.StartRunRequest(request_id=uuid.uuid4().hex, config=config), timeout=300).run
    events: list[common_pb2.MetricEvent] = []
    with tqdm(total=run.total_steps, desc=label, unit="step", disable=not progress, dynamic_ncols=True) as bar:
        for reply in stub.StreamMetrics(messages.StreamMetricsRequest(run_id=run.run_id)):
            event = reply.event
            events.append(event)
            if event.kind == "train":
                bar.update(max(0, event.step - bar.n))
                bar.set_postfix({k.split("/")[-1] if "/" in k else k: f"{event.values[k]:.2f}"
                                 for k in postfix_keys if k in event.values}, refresh=False)
            elif event.kind == "eval":
                for prefix, name in (("", "held-out"), ("train_tasks/", "training tasks")):
                    turns = [f"turn {t}: {event.values[f'{prefix}pass_at_1/turn_{t}']:.2f}" for t in range(1, 10)
                             if f"{prefix}pass_at_1/turn_{t}" in event.values]
                    if turns:
                        bar.write(f"  {label} step {event.step}: {name} pass@1 " + " ".join(turns))
            if event.kind == "state" and event.state in TERMINAL:
                break
    final = stub.GetRun(messages.GetRunRequest(run_id=run.run_id), timeout=60).run
    if final.state != RunState.RUN_STATE_SUCCEEDED:
        raise RunFailed(f"{label} run {final.run_id} ended {RunState.Name(final.state)}: {final.error or 'no error given'}"
                        f" (its directory: {final.output_dir})")
    return FinishedRun(final, events)
