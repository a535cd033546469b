"""`python -m svc_sandbox.zygote FD`: a sandbox worker's fork server (see isolation.py)."""

import sys

from svc_sandbox.isolation import zygote_main

if __name__ == "__main__":
    zygote_main(int(sys.argv[1]))
