"""kvledger: the CLI and the demo, the one place that wires producer and consumer together."""

__version__ = "0.3.0"
