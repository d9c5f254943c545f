"""Run metadata shared by the benchmark scripts."""
import os
import subprocess


def commit() -> str:
    """The commit being measured: $JAXKV_COMMIT (set it on machines without .git), else git."""
    if os.environ.get("JAXKV_COMMIT"):
        return os.environ["JAXKV_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)),
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"
