"""Prepare a manifest, image folder, COCO JSON, Parquet or datasets folder for training.

    python tools/prepare_data.py SOURCE --out DIR [flags]

A thin wrapper kept for checkouts and existing scripts: the command is ``mmfast.cli.prepare`` (installed as
``mmfast-prepare``; ``mmfast-prepare --help`` lists its flags).
"""

import sys

from mmfast.cli.prepare import input_options, main, parse_args  # noqa: F401  (tests and scripts call these)

if __name__ == "__main__":
    sys.exit(main())
