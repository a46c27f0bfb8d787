"""Profile a training configuration (phases, utilization, verdict).

    python tools/profile_run.py [train flags ...] [--steps 30] [--trace] [--out runs/profile]

(Not named profile.py: that name would shadow the standard library's `profile` module, which
cProfile and so torch import, whenever tools/ is on the import path.)

A thin wrapper kept for checkouts and existing scripts: the command is ``mmfast.cli.profile_run`` (installed as
``mmfast-profile``; ``mmfast-profile --help`` lists its flags).
"""

import sys

from mmfast.cli.profile_run import main, print_report  # noqa: F401  (tests and scripts call these)

if __name__ == "__main__":
    sys.exit(main())
