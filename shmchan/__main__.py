"""`python -m shmchan`: the command line (see `shmchan.cli`)."""

from shmchan.cli import main

if __name__ == "__main__":  # not when a spawned child re-imports this module
    raise SystemExit(main())
