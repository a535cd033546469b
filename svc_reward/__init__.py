"""`leap serve reward`: Difficulty-Conditioned Pruning and tournament rank rewards."""
