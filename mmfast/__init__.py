"""mmfast: fast multimodal (image + text) training.

The pieces most users touch: ``MultimodalLoader`` / ``ImageLoader`` (DALI loaders), ``TokenCache``,
``build_model`` (fusion models), ``mmfast.train.train`` (the Accelerate loop), ``mmfast.profiler``,
``load_model`` (a trained run's model directory).
"""

from mmfast.loader import ImageLoader, MultimodalLoader
from mmfast.model_dir import MmfastModel, load_model
from mmfast.models import build_model
from mmfast.token_cache import TokenCache

__all__ = ["ImageLoader", "MmfastModel", "MultimodalLoader", "TokenCache", "build_model", "load_model"]
__version__ = "0.1.0"
