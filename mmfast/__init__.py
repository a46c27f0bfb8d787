"""mmfast: fast multimodal (image + text) training."""

from mmfast.token_cache import TokenCache

__all__ = ["TokenCache"]
__version__ = "0.1.0"
