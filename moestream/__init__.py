"""moestream: run Mixture-of-Experts language models larger than GPU memory."""

__version__ = "0.1.0"
