"""dspark-calib: offline cost tables for vLLM's DSpark adaptive verification."""

__version__ = "0.1.0"
