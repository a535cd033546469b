"""`leap serve distill`: TU-OPD distillation with Consensus-Residual Decomposition, as runs."""
