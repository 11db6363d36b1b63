"""Pixels -> region/grid features: ImageNet CNN backbones and the precomp extractor."""

from itmatch.features.backbones import BACKBONE_NAMES, Backbone, backbone_spec, load_backbone
from itmatch.features.extract import extract_precomp

__all__ = ["BACKBONE_NAMES", "Backbone", "backbone_spec", "extract_precomp", "load_backbone"]
