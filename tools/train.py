"""Train an image+text model: a fusion classifier, or a contrastive dual encoder (--model clip).

    accelerate launch tools/train.py [flags]      (or: python tools/train.py, torchrun ...)

With no flags it generates the built-in demo dataset and trains the tiny preset on it.

A thin wrapper kept for checkouts and existing scripts: the command is ``mmfast.cli.train`` (installed as
``mmfast-train``; ``mmfast-train --help`` lists its flags).
"""

import sys

from mmfast.cli.train import main, print_table  # noqa: F401  (tests and scripts call these)

if __name__ == "__main__":
    sys.exit(main())
