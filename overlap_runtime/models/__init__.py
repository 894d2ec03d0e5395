"""Model building blocks (Qwen3.5-style layers)."""

from .gated_deltanet import GatedDeltaNet, GDNProjections, RMSNormGated

__all__ = ["GDNProjections", "GatedDeltaNet", "RMSNormGated"]
