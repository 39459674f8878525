"""Helpers shared by zeroio's tests: the multi-rank harness and conformance suites.

Submodules (imported on use): ``reference`` (plain-PyTorch AdamW), ``models`` (the tiny tied
Llama and MLP, their data, configs and reference runs), ``training`` (train an engine, read
back masters and published params, compare with the reference), ``cuda``."""

from zeroio.testing.multirank import free_port, run_ranks

__all__ = ["run_ranks", "free_port"]
