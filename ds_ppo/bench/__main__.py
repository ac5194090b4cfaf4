"""`python -m ds_ppo.bench`: the benchmark's command line (cli.py)."""
import sys

from ds_ppo.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
