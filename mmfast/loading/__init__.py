"""Layer 2, one process's epochs of batches: the pure DALI graphs (``graphs``), image sources (``sources``),
sampling strategies (``sampling``), the live stream and its resume state (``stream``), bad-file watching
(``file_health``), the decoded-image cache and its one policy (``decoded``), host-side finishing
(``host_finish``), what torch DataLoader code passes and expects (``dropin``), and the two loaders:
``image_loader.ImageLoader`` and ``multimodal.MultimodalLoader`` (an image loader plus a token cache).
Imports ``mmfast.data`` and ``mmfast.util``."""
