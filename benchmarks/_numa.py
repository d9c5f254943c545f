"""Where the benchmark's GPU sits on the host: its NUMA node and local CPUs (Linux sysfs).

The host tier is read over PCIe from pinned pages; pages on the other socket's memory cross
the inter-socket link first. Under Linux's default first-touch policy the pinned pages land
on the node of the thread that allocates them, so binding the process to the GPU's local CPUs
before JAX starts should also place the tier (unverified: the H200 machines at hand have one
NUMA node, where binding changes nothing; docs/decisions.md).
"""
from __future__ import annotations

import os
import subprocess


def _gpu_index() -> int:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def _parse_cpulist(text: str) -> list[int]:
    cpus = []
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            cpus.extend(range(int(a), int(b) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def gpu_numa() -> dict:
    """{"gpu", "bus_id", "numa_node", "local_cpus", "nodes", "affinity"} for the first visible
    GPU (physical index from CUDA_VISIBLE_DEVICES); fields are None where unknown."""
    info = {"gpu": _gpu_index(), "bus_id": None, "numa_node": None, "local_cpus": None,
            "nodes": None, "affinity": sorted(os.sched_getaffinity(0))}
    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader",
                              "-i", str(info["gpu"])], capture_output=True, text=True,
                             timeout=20, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - no GPU / no nvidia-smi
        return info
    sysfs = "/sys/bus/pci/devices/" + bus.lower()[-12:]   # 00000000:18:00.0 -> 0000:18:00.0
    info["bus_id"] = bus
    try:
        with open(sysfs + "/numa_node") as f:
            info["numa_node"] = int(f.read())
        with open(sysfs + "/local_cpulist") as f:
            info["local_cpus"] = _parse_cpulist(f.read())
        info["nodes"] = len([d for d in os.listdir("/sys/devices/system/node")
                             if d.startswith("node") and d[4:].isdigit()])
    except OSError:
        pass
    return info


def bind_to_gpu() -> dict:
    """Restrict this process to its GPU's local CPUs (call before JAX allocates anything).
    Returns gpu_numa() after binding (``bound`` True if the affinity changed)."""
    info = gpu_numa()
    cpus = info.get("local_cpus")
    bound = False
    if cpus and set(cpus) != set(info["affinity"]):
        os.sched_setaffinity(0, cpus)
        bound = True
    info = gpu_numa()
    info["bound"] = bound
    return info
