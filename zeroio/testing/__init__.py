"""Helpers shared by zeroio's tests: the multi-rank harness and conformance suites.

Submodules (imported on use): ``reference`` (plain-PyTorch AdamW), ``models`` (the tiny tied
Llama and MLP, their data, configs and reference runs), ``training`` (train an engine, read
back masters and published params, compare with the reference), ``cuda``.

Conformance suites, subclassed by a test module with the implementation under test (as
``zarr.testing`` does; they need pytest and hypothesis): ``store`` (``TieredStoreTests``, the
tiered store against a dict over any NVMe backend, and ``NvmeBackendTests``, the backend
contract), ``io_engine`` (``IOEngineTests``: round trips against the file's raw bytes) and
``tensor_store`` (``TensorStoreTests``: round trips checked through zarr)."""

from zeroio.testing.multirank import free_port, run_ranks

__all__ = ["run_ranks", "free_port"]
