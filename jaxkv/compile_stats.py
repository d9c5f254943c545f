"""Counts XLA backend compilations (and their time) through jax.monitoring events."""
from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_time = 0.0
_registered = False


def _listener(event: str, duration: float, **_):
    global _count, _time
    if event == _EVENT:
        with _lock:
            _count += 1
            _time += duration


def _ensure_registered():
    global _registered
    if not _registered:
        jax.monitoring.register_event_duration_secs_listener(_listener)
        _registered = True


def snapshot() -> tuple[int, float]:
    """(compilations so far, seconds spent compiling) since the listener was registered."""
    _ensure_registered()
    return _count, _time


def since(snap: tuple[int, float]) -> dict:
    """Compilations and compile seconds since ``snap``."""
    return {"count": _count - snap[0], "time_s": _time - snap[1]}


_ensure_registered()
