"""`leap serve trainer`: The GRPO learner, the LEAP loop and RGRPO teacher rounds, as runs."""
