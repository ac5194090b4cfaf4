import sys

from ds_ppo.cli import main

sys.exit(main())
