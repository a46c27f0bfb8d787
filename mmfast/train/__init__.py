"""The training engine: configuration, process/data setup, the loop, checkpoints."""

from mmfast.train.config import TrainConfig, parse_config
from mmfast.train.engine import train

__all__ = ["TrainConfig", "parse_config", "train"]
