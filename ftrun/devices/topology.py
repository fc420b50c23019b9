"""Which CPUs sit near each device: the "CPU Affinity" column of the vendors' topology matrices.

``npu-smi info -t topo`` (Ascend) and ``nvidia-smi topo -m`` (CUDA) print the same shape: a
header row naming the columns (devices, NICs, then ``CPU Affinity`` and maybe ``NUMA Affinity``),
then one row per device, named ``NPU<i>`` or ``GPU<i>``, with one link word per column and the
CPU list (``0-23,48-71``) after them, then a legend. Column headers never hold spaces except the
affinity ones, and cells never do, so a row's CPU list is the word after as many cells as the
header has columns before ``CPU Affinity``. tests/fixtures/npu_smi/topo_a2.txt is the layout.
"""

from __future__ import annotations

import re

from ftrun.devices import DeviceToolError


def parse_cpu_list(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` as a set of CPU numbers; ValueError for anything else (N/A, junk)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        match = re.fullmatch(r"(\d{1,6})(?:-(\d{1,6}))?", part.strip())
        if match is None:
            raise ValueError(f"not a CPU list: '{text}'")
        low = int(match.group(1))
        high = int(match.group(2) or low)
        if high < low:
            raise ValueError(f"not a CPU list: '{text}'")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def parse_affinity_matrix(text: str, row_name: str) -> dict[int, frozenset[int]]:
    """Device index -> its CPUs, from a topology matrix whose device rows start with ``row_name``
    (NPU or GPU). Rows whose affinity is not a CPU list (N/A) are left out; no header or no
    device row at all is a DeviceToolError."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if re.search(r"cpu\s+affinity", line, re.I)), None)
    if header is None:
        raise DeviceToolError("the topology has no 'CPU Affinity' column")
    before = re.split(r"cpu\s+affinity", lines[header], flags=re.I)[0].split()
    found: dict[int, frozenset[int]] = {}
    for line in lines[header + 1:]:
        words = line.split()
        match = re.fullmatch(rf"{row_name}(\d+)", words[0], re.I) if words else None
        if match is None or len(words) <= len(before) + 1:
            continue
        try:
            found[int(match.group(1))] = parse_cpu_list(words[len(before) + 1])
        except ValueError:
            continue  # N/A: this device's affinity is unknown
    if not found:
        raise DeviceToolError(f"the topology names no {row_name} with a CPU affinity")
    return found
