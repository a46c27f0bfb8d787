"""Export a trained model directory to ONNX and/or torch.export.

    python tools/export.py --model runs/latest/model --out runs/latest/export

A thin wrapper kept for checkouts and existing scripts: the command is ``mmfast.cli.export`` (installed as
``mmfast-export``; ``mmfast-export --help`` lists its flags).
"""

import sys

from mmfast.cli.export import main  # noqa: F401  (tests and scripts call these)

if __name__ == "__main__":
    sys.exit(main())
