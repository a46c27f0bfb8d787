"""Predict with a trained model directory.

    python tools/predict.py --model runs/latest/model --input new.jsonl --out predictions.jsonl

A thin wrapper kept for checkouts and existing scripts: the command is ``mmfast.cli.predict`` (installed as
``mmfast-predict``; ``mmfast-predict --help`` lists its flags).
"""

import sys

from mmfast.cli.predict import main  # noqa: F401  (tests and scripts call these)

if __name__ == "__main__":
    sys.exit(main())
