"""Diffuse: peer-to-peer LLM inference that is private, verifiable and survives peer failures."""

__version__ = "0.1.0"
