"""The DeepSpeed release whose Python API the facade follows (its ``__version__`` and the
version ``importlib.metadata`` reports for the ``deepspeed`` distribution)."""

FOLLOWS = "0.18.0"
