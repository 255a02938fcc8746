"""PithTrain: a compact Mixture-of-Experts training framework on PyTorch."""

__version__ = "0.1.0"
