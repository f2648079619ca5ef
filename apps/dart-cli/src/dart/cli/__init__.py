"""The dart command."""

__version__ = "0.1.0"
