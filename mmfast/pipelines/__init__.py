"""DALI pipeline graphs (installed as ``mmfast.pipelines``): pure @pipeline_def functions."""

from mmfast.pipelines.image import IMAGENET_MEAN, IMAGENET_STD, image_pipeline

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "image_pipeline"]
