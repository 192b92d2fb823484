"""omnistage: a compact inference engine for omni-modal models."""

__version__ = "0.1.0"
