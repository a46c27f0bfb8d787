"""The image preprocessing every stage agrees on, defined once: the normalization of ImageNet-trained
backbones and the eval geometry (resize the shorter side to ``size / EVAL_CROP_RATIO``, keep the centre
``size x size``). The loaders' graphs, a model directory's config.json and predict's plain baseline read
them from here."""

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)  # 0..255 units, as DALI takes them
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
EVAL_CROP_RATIO = 0.875  # 224 -> 256, like torchvision's Resize(256) + CenterCrop(224)
