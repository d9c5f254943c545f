"""The installed distribution: ``pip install .`` (a wheel, not editable) into a fresh venv,
used from a user's project that has its own top-level ``models`` package. The repository's
``models/`` and ``pallas_kernels/`` install as ``jaxkv.models`` and ``jaxkv.kernels``, so the
user's ``models`` stays theirs and ``jaxkv.generate`` still works."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = textwrap.dedent("""
    import models                      # the user's own package, not jaxkv's
    assert models.OWNER == "user", models.__file__
    import jaxkv
    from jaxkv import CacheConfig
    from jaxkv.models import configs, llama
    from jaxkv.kernels import quest
    for mod in (jaxkv, configs, quest):
        assert "site-packages" in mod.__file__, mod.__file__
    cfg = configs.tiny()
    res = jaxkv.generate(cfg, llama.init_params(cfg, seed=0), [[5, 6, 7, 8, 9]],
                         max_new_tokens=3, stop_tokens=[],
                         cache=CacheConfig(mode="host", page_size=4, selected_pages=2))
    assert len(res.tokens[0]) == 3, res.tokens
    import importlib.metadata as md
    top = {f.parts[0] for f in md.files("jaxkv") if f.parts[0] != "bin"}
    print("OK", sorted(top))
""")


@pytest.mark.slow
def test_wheel_install_next_to_a_user_models_package(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True)
    (wheel,) = wheels.glob("jaxkv-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # jaxkv's dependencies from this interpreter's site-packages (after the venv's own, and
    # without running their .pth files, so this checkout's editable install stays out)
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "_test_deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", str(wheel)], check=True)
    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "__init__.py").write_text('OWNER = "user"\n')
    (project / "run.py").write_text(USER_SCRIPT)
    out = subprocess.run([str(py), "run.py"], cwd=project, capture_output=True, text=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("OK"), out.stdout
    # the wheel's top-level entries: jaxkv and its dist-info, nothing named models / kernels
    assert "models" not in last and "pallas_kernels" not in last, last


def test_subpackages_are_lazy_attributes():
    """``import jaxkv`` then ``jaxkv.models.load`` (as the README writes it) works without
    importing ``jaxkv.models`` first, and ``import jaxkv`` alone does not import it; an
    unknown attribute is an AttributeError naming it."""
    script = textwrap.dedent("""
        import sys
        import jaxkv
        assert "jaxkv.models" not in sys.modules
        assert callable(jaxkv.models.load) and "jaxkv.models" in sys.modules
        assert jaxkv.kernels.__name__ == "jaxkv.kernels"
        try:
            jaxkv.nothing
        except AttributeError as e:
            assert "'nothing'" in str(e), e
        else:
            raise AssertionError("jaxkv.nothing")
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-3000:]
