"""Model families, chosen by the HF ``architectures`` field."""

from plait.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
