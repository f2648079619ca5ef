"""dart.protocol: the contract, what crosses a process boundary."""

__version__ = "0.1.0"
