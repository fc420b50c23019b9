"""The node's accelerators: what they are, and what their tools read of their health.

One backend per kind (``--device {auto,npu,cuda,cpu}``):

* npu: Ascend, through ``npu-smi`` (``ftrun.devices.npu``);
* cuda: NVIDIA, through NVML (``nvidia-ml-py``) or else ``nvidia-smi`` (``ftrun.devices.cuda``);
* cpu: no devices, no device faults (tests, CPU jobs).

Every backend answers two questions: :meth:`DeviceBackend.discover` (which devices,
by the logical index the runtime counts in) and :meth:`DeviceBackend.poll` (each
device's health and error codes, a :class:`DeviceReading`). A tool that is missing, hangs or prints nonsense
raises :class:`DeviceToolError` with one line; callers log it and carry on.
"""

from __future__ import annotations

import enum
import os
import shutil
from dataclasses import dataclass
from typing import Protocol

DEVICE_KINDS = ("auto", "npu", "cuda", "cpu")


class Health(enum.Enum):
    """A device's health as its tool reports it (npu-smi's words; NVML's mapped onto them)."""

    #: normal
    OK = "OK"
    #: a minor fault: log it
    WARNING = "Warning"
    #: a major fault
    ALARM = "Alarm"
    #: a critical fault
    CRITICAL = "Critical"
    #: absent, not started, or its tool could not say
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, text: str) -> "Health":
        """Case-insensitive; anything unrecognised is UNKNOWN."""
        word = text.strip().lower()
        return next((h for h in cls if h.value.lower() == word), cls.UNKNOWN)


@dataclass(frozen=True)
class Device:
    """One compute device of the node."""

    #: the logical id the runtime counts in (ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)
    index: int
    #: the product name (910B2, NVIDIA H100 80GB HBM3)
    name: str = ""
    #: where the hardware is: "npu 3 chip 0" for Ascend, the PCI bus id or UUID for CUDA
    physical: str = ""


@dataclass(frozen=True)
class DeviceReading:
    """What a device tool read of one device at one poll: its health and error codes."""

    device: Device
    health: Health
    #: vendor error codes (Ascend: 8 hex digits, upper case), or NVML findings ("xid 79")
    codes: tuple[str, ...] = ()
    #: the tool's own words about the fault, continuation lines joined with "; "
    info: str = ""


class DeviceToolError(Exception):
    """The device tool is missing, timed out, failed or printed something unreadable."""


class DeviceBackend(Protocol):
    kind: str
    #: the environment variable that restricts which devices a worker sees, or None
    visibility_var: str | None

    def discover(self) -> list[Device]:
        """The node's compute devices, by logical index. Raises DeviceToolError."""

    def poll(self) -> list[DeviceReading]:
        """Every device's health now. Raises DeviceToolError."""

    def reset(self, index: int) -> None:
        """Reset one device (no process may use it). Raises DeviceToolError."""


class CpuBackend:
    """No accelerators: nothing to discover, nothing can fail."""

    kind = "cpu"
    visibility_var: str | None = None

    def discover(self) -> list[Device]:
        return []

    def poll(self) -> list[DeviceReading]:
        return []

    def reset(self, index: int) -> None:
        raise DeviceToolError("there is no device to reset on a CPU node")


@dataclass(frozen=True)
class DeviceOptions:
    """How to reach the device tools."""

    npu_smi: str = "npu-smi"
    hccn_tool: str = "hccn_tool"
    nvidia_smi: str = "nvidia-smi"
    #: seconds one tool call may take before it is killed
    timeout: float = 10.0
    #: seconds a device reset may take, from the reset command to the device reading healthy again
    reset_timeout: float = 120.0
    #: seconds to wait after a reset before reading any device's health (npusmi_074: at least 20 s;
    #: a read at once may still see the chip's state from before the reset)
    reset_wait: float = 20.0


def detect_kind(options: DeviceOptions, env=os.environ) -> str:
    """``--device auto``: npu when npu-smi is there, cuda when nvidia-smi or NVML is, else cpu."""
    if shutil.which(options.npu_smi, path=env.get("PATH")):
        return "npu"
    if shutil.which(options.nvidia_smi, path=env.get("PATH")):
        return "cuda"
    return "cpu"


def make_device_backend(kind: str, options: DeviceOptions = DeviceOptions()) -> DeviceBackend:
    """The backend for ``kind`` (one of DEVICE_KINDS); its tools are looked for only when used."""
    if kind == "auto":
        kind = detect_kind(options)
    if kind == "npu":
        from ftrun.devices.npu import NpuBackend

        return NpuBackend(options)
    if kind == "cuda":
        from ftrun.devices.cuda import CudaBackend

        return CudaBackend(options)
    if kind == "cpu":
        return CpuBackend()
    raise ValueError(f"unknown device kind '{kind}': choose one of {', '.join(DEVICE_KINDS)}")
