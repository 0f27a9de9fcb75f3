"""keel: a PyTorch-native LLM systems stack (train, adapt, serve) on one model definition."""

__version__ = "0.1.0"
