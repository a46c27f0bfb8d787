"""mmfast: fast multimodal (image + text) training.

The pieces most users touch: ``MultimodalLoader`` / ``ImageLoader`` (DALI loaders), ``TokenCache``,
``build_model`` (fusion models), ``mmfast.train.train`` (the Accelerate loop), ``mmfast.profiler``.
"""

from mmfast.loader import ImageLoader, MultimodalLoader
from mmfast.models import build_model
from mmfast.token_cache import TokenCache

__all__ = ["ImageLoader", "MultimodalLoader", "TokenCache", "build_model"]
__version__ = "0.1.0"
