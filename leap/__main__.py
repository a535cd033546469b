"""`python -m leap` is the `leap` command."""

from leap.cli import main

raise SystemExit(main())
