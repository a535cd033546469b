"""Learner code shared by the trainer (GRPO) and the distiller (TU-OPD).

- `Learner`, `LearnerSettings`, `Normalizer`: a trainable causal LM, its AdamW and schedule,
  gradient accumulation to a token budget, logprobs, checkpoints, full weights (learner.py);
- `Sequence`, `Batch`, `collate`, `micro_batches`, `shard`, `with_values`: token sequences
  with loss masks and named per-token values (sequences.py);
- `OptimizerSettings`, `Schedule`: the optimizer config with its defaults (optim.py);
- `token_logprobs`, `load_model`, `load_tokenizer`, `check_model_dir`: models (model.py);
- `World`, `current_world`, `release_followers`: several processes (distributed.py), and
  `follow`, the loop of a follower rank (learner.py);
- checkpoints on disk: `CheckpointInfo`, `list_checkpoints`, `latest_checkpoint` (checkpoint.py);
- `MetricsLog`, `plot_metrics`: JSONL, TensorBoard and PNG curves (metrics.py);
- experiment trackers beside the metric log: MLflow, W&B, trackio (reporters.py);
- `RunRegistry`, `RunRecord`, `RunContext`: runs as persisted resources (registry.py), and
  `RunApi`, the run RPCs of a learner service over a registry (run_api.py);
- `combine_stats`: loss statistics over micro-batches and ranks (stats.py);
- `draw_tasks`: the seeded, cursor-addressed order of training tasks (data.py).

This package never imports a service package (`svc_*`).
"""

from leap.learning.checkpoint import CheckpointInfo, latest_checkpoint, list_checkpoints
from leap.learning.distributed import World, current_world, release_followers
from leap.learning.learner import Learner, LearnerSettings, NonFiniteError, Normalizer, follow
from leap.learning.model import check_model_dir, load_model, load_tokenizer, token_logprobs
from leap.learning.optim import OptimizerSettings, Schedule
from leap.learning.sequences import Batch, Sequence, collate, micro_batches, shard, with_values
from leap.learning.stats import combine_stats

__all__ = [
    "Batch",
    "CheckpointInfo",
    "Learner",
    "LearnerSettings",
    "NonFiniteError",
    "Normalizer",
    "OptimizerSettings",
    "Schedule",
    "Sequence",
    "World",
    "check_model_dir",
    "collate",
    "combine_stats",
    "current_world",
    "follow",
    "latest_checkpoint",
    "list_checkpoints",
    "load_model",
    "load_tokenizer",
    "micro_batches",
    "release_followers",
    "shard",
    "token_logprobs",
    "with_values",
]
