"""servopt: make trained neural networks fast and cheap to serve."""

__version__ = "0.1.0"
