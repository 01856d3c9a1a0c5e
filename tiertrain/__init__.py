"""tiertrain: full-precision training of models larger than GPU memory on one GPU."""

__version__ = "0.1.0"
