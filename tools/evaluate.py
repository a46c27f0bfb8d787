"""Evaluate a trained model directory on a prepared split or a labeled manifest.

    python tools/evaluate.py --model runs/latest/model --data prepared/ --split val

A thin wrapper kept for checkouts and existing scripts: the command is ``mmfast.cli.evaluate`` (installed as
``mmfast-evaluate``; ``mmfast-evaluate --help`` lists its flags).
"""

import sys

from mmfast.cli.evaluate import main  # noqa: F401  (tests and scripts call these)

if __name__ == "__main__":
    sys.exit(main())
