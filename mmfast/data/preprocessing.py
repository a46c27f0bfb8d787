"""The image preprocessing every stage agrees on, defined once: the normalization of ImageNet-trained
backbones, the eval geometry (resize the shorter side to ``size / EVAL_CROP_RATIO``, keep the centre
``size x size``) and a model directory's eval resize, mmfast's own or its start's. The loaders' graphs, a
model directory's config.json and predict's plain baseline read them from here."""

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)  # 0..255 units, as DALI takes them
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
EVAL_CROP_RATIO = 0.875  # 224 -> 256, like torchvision's Resize(256) + CenterCrop(224)
INTERPOLATIONS = ("bilinear", "bicubic")  # the resize filters the graphs and the host finishing reproduce
# eval: "shortest" resizes the shorter side to size / crop_ratio and keeps the centre; "squash" resizes the
# whole picture to size x size, its aspect ratio lost (SigLIP's processor, open_clip's resize_mode="squash")
RESIZE_MODES = ("shortest", "squash")


def eval_resize(config: dict) -> dict:
    """A model directory's eval resize, as the loaders take it: {"crop_ratio", "interpolation", "resize_mode"}
    (mmfast's own for a directory that names none)."""
    return {
        "crop_ratio": config.get("crop_ratio", EVAL_CROP_RATIO),
        "interpolation": config.get("interpolation", "bilinear"),
        "resize_mode": config.get("resize_mode", "shortest"),
    }
