"""What a worker runs on: its device and memory (for the admin), and per-GPU utilization and
memory (for ``/metrics``), read from NVML where a GPU exists.

NVML comes from the ``nvidia-ml-py`` package (module ``pynvml``), imported lazily through
torch's ``torch.cuda.utilization`` / ``torch.cuda.device_memory_used``, which map CUDA's
device indices (``CUDA_VISIBLE_DEVICES`` applied) to NVML's. Without a GPU, or without the
package, no GPU samples are reported and nothing fails.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch

logger = logging.getLogger(__name__)
_nvml_warned = False


def describe_device() -> dict[str, Any]:
    """``{"host", "device", "memory_used_bytes", "memory_total_bytes"}`` of this process: the
    first CUDA device it sees (device-wide memory), else the CPU (this process's resident
    memory out of the machine's)."""
    info: dict[str, Any] = {"host": socket.gethostname()}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(0)
        info.update(device=f"cuda:0 ({torch.cuda.get_device_name(0)})", memory_used_bytes=total - free,
                    memory_total_bytes=total)
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
        info.update(device="cpu", memory_used_bytes=resident_pages * page,
                    memory_total_bytes=os.sysconf("SC_PHYS_PAGES") * page)
    return info


def gpu_stats() -> list[dict[str, Any]]:
    """Per visible CUDA device: ``{"device": index (str), "utilization": 0..1 (fraction of the
    last sample period a kernel ran), "memory_used_bytes": int (device-wide)}``; empty
    without a GPU or NVML."""
    global _nvml_warned
    if not torch.cuda.is_available():
        return []
    stats = []
    for index in range(torch.cuda.device_count()):
        try:
            stats.append({"device": str(index), "utilization": torch.cuda.utilization(index) / 100.0,
                          "memory_used_bytes": int(torch.cuda.device_memory_used(index))})
        except Exception as error:  # pynvml missing, or NVML unusable (no driver access)
            if not _nvml_warned:
                _nvml_warned = True
                logger.warning("GPU utilization and memory are not reported: NVML is unavailable (%s); "
                               "install nvidia-ml-py", error)
            return []
    return stats
