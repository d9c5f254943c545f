"""Test configuration: GPU tests (marker ``gpu``) are skipped unless JAX sees a GPU."""
import jax
import pytest


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_interpret(monkeypatch):
    """Lower the real Triton kernels (not interpret mode) although JAX runs on the CPU."""
    from jaxkv.kernels import _common
    monkeypatch.setattr(_common, "interpret_mode", lambda: False)
