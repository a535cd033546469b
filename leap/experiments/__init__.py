"""What the `leap demo`, `leap dcp-experiment` and `leap expand-compress` commands share: a
local stack on free loopback ports serving a given model, following a run with a progress
bar, and reading its metric events into tables and plots."""
