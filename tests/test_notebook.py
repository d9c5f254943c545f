"""Executes notebooks/quickstart.ipynb top to bottom (nbclient, a kernel on this Python)."""
import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
KERNEL = "jaxkv-test-python"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernelspec for this interpreter (the venv), found through JUPYTER_PATH."""
    spec_dir = tmp_path / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxkv test", "language": "python", "env": env}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return KERNEL


def test_quickstart_notebook_runs(kernel_name):
    try:
        from jaxkv.models.gguf_loader import default_model_path
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert "pass key found: True" in text
    assert "step  1: hit rate 0.00" in text            # per-step counters, empty pool at first
    assert "reused " in text and "Write the pass key in words. ->" in text  # kept context
    assert "hit_rate" in text and "bytes_host_to_device" in text
    assert any("image/png" in o.get("data", {}) for o in outputs
               if o.get("output_type") == "display_data"), "no plot was produced"
