"""`leap serve sandbox`: Compile, run, check and time candidate kernels, safely."""
