"""NVIDIA GPUs: through NVML (``nvidia-ml-py``) when it is installed and works, else ``nvidia-smi``.

Both paths produce the same ``fields`` mapping (nvidia-smi's query names to its
text values), and one pure function, :func:`reading_from_fields`, turns it into a
:class:`DeviceReading`. What ftrun reports as codes, and why:

* ``gpu-lost`` (Critical): the driver cannot reach the GPU (NVML_ERROR_GPU_IS_LOST,
  "[GPU is lost]", "Unknown Error"); it has usually fallen off the bus (Xid 79).
* ``ecc-uncorrected`` (Alarm): uncorrected ECC errors since the driver loaded.
* ``retired-pages-pending`` (Alarm): pages or rows wait to be retired or remapped,
  which happens only at the next GPU reset.
* ``row-remap-failure`` (Alarm): the GPU ran out of spare rows.
* ``xid-N``: a critical Xid event, reported by NVML only (health by :data:`XID_HEALTH`).

Device indices are NVML's, which equal the CUDA runtime's when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
(the usual setting on training nodes; CUDA's own default order is fastest first).
"""

from __future__ import annotations

import csv
import logging
import os
import re
from typing import Mapping, Sequence

from ftrun.devices import Device, DeviceOptions, DeviceReading, DeviceToolError, Health
from ftrun.devices.tool import run_tool
from ftrun.devices.topology import parse_affinity_matrix

log = logging.getLogger(__name__)

#: what ``nvidia-smi --query-gpu`` is asked for, in this order
GPU_FIELDS = (
    "index", "name", "pci.bus_id", "uuid", "ecc.errors.uncorrected.volatile.total", "retired_pages.pending",
)
#: row remapping (Ampere and later) has its own query; older GPUs and drivers refuse it
REMAP_FIELDS = ("gpu_bus_id", "remapped_rows.pending", "remapped_rows.failure")
#: what the parser puts in ``error`` for a GPU nvidia-smi could not open
ERROR_FIELD = "error"

#: Xids that mean the hardware, not the program, failed; the rest are logged (Warning)
XID_HEALTH = {
    79: Health.CRITICAL,  # fallen off the bus
    48: Health.ALARM,  # double-bit ECC error
    64: Health.ALARM,  # row remapping could not be recorded
    74: Health.ALARM,  # NVLink error
    92: Health.ALARM,  # high single-bit ECC rate
    94: Health.ALARM,  # contained ECC error
    95: Health.ALARM,  # uncontained ECC error
}

_LOST_WORDS = ("gpu is lost", "unknown error")
_UNKNOWN_WORDS = ("n/a", "not supported", "insufficient permissions", "")
_HANDLE_ERROR = re.compile(r"unable to determine the device handle for gpu\s*(?P<rest>.*)", re.IGNORECASE)
_BUS_ID = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]", re.IGNORECASE)


def parse_nvidia_smi_csv(text: str, fields: Sequence[str] = GPU_FIELDS) -> list[dict[str, str]]:
    """Rows of ``--format=csv,noheader,nounits`` output, each a mapping of ``fields`` to text.

    A GPU nvidia-smi could not open ("Unable to determine the device handle for GPU1:
    0000:34:00.0: Unknown Error") becomes a row with ``error`` and whatever of
    ``index`` / ``pci.bus_id`` the message names. Raises ValueError on any other
    line that does not have one value per field.
    """
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        lost = _HANDLE_ERROR.search(line)
        if lost:
            rows.append(_handle_error_row(lost.group("rest")))
            continue
        values = next(csv.reader([line], skipinitialspace=True))
        if len(values) != len(fields):
            raise ValueError(f"expected {len(fields)} values, got {len(values)}: {line.strip()[:120]}")
        rows.append({name: value.strip() for name, value in zip(fields, values)})
    return rows


def _handle_error_row(rest: str) -> dict[str, str]:
    # the driver's wording varies: "GPU0000:08:00.0: Unknown Error", "GPU1: 0000:34:00.0: ...", "GPU 0: ..."
    row = {ERROR_FIELD: rest.rsplit(":", 1)[-1].strip().rstrip(".") or "Unknown Error"}
    bus = _BUS_ID.search(rest)
    if bus:
        row["pci.bus_id"] = bus.group(0)
    index = re.match(r"\s*(\d+)\s*:", rest[: bus.start()] if bus else rest)
    if index:
        row["index"] = index.group(1)
    return row


def _known(value: str | None) -> str | None:
    """The value, or None where the tool could not say ("[N/A]", "[Not Supported]")."""
    if value is None:
        return None
    word = value.strip().strip("[]").strip().lower()
    return None if word in _UNKNOWN_WORDS else value.strip()


def _is_lost(value: str | None) -> bool:
    return value is not None and value.strip().strip("[]").strip().lower() in _LOST_WORDS


def _is_yes(value: str | None) -> bool:
    word = (_known(value) or "").lower()
    if word in ("yes", "true", "enabled", "active"):
        return True
    return word.isdigit() and int(word) > 0


def bus_key(bus_id: str) -> str:
    """A PCI bus id in one spelling: nvidia-smi writes the domain with 8 digits, the driver's messages with 4."""
    text = bus_id.strip().lower()
    domain, _, rest = text.partition(":")
    if rest.count(":") == 1 and re.fullmatch(r"[0-9a-f]+", domain):
        return f"{int(domain, 16):04x}:{rest}"
    return text


def device_from_fields(fields: Mapping[str, str], fallback_index: int = -1) -> Device:
    """The :class:`Device` a row describes (its index, else ``fallback_index``)."""
    index = _known(fields.get("index"))
    return Device(
        index=int(index) if index and index.isdigit() else fallback_index,
        name=_known(fields.get("name")) or "",
        physical=_known(fields.get("pci.bus_id")) or _known(fields.get("uuid")) or "",
    )


def reading_from_fields(device: Device, fields: Mapping[str, str], xids: Sequence[int] = ()) -> DeviceReading:
    """Health and codes of one GPU from its query values (and the critical Xids NVML reported)."""
    if fields.get(ERROR_FIELD) or any(_is_lost(v) for v in fields.values()):
        why = fields.get(ERROR_FIELD) or next(v for v in fields.values() if _is_lost(v))
        return DeviceReading(device, Health.CRITICAL, ("gpu-lost",), f"GPU is not reachable: {why.strip('[] ')}")

    findings: list[tuple[Health, str, str]] = []
    ecc = _known(fields.get("ecc.errors.uncorrected.volatile.total"))
    if ecc and ecc.isdigit() and int(ecc) > 0:
        findings.append((Health.ALARM, "ecc-uncorrected", f"{ecc} uncorrected ECC errors since the driver loaded"))
    if _is_yes(fields.get("retired_pages.pending")):
        findings.append((Health.ALARM, "retired-pages-pending", "retired pages pending: they take effect at the next reset"))
    if _is_yes(fields.get("remapped_rows.pending")):
        findings.append((Health.ALARM, "retired-pages-pending", "row remapping pending: it takes effect at the next reset"))
    if _is_yes(fields.get("remapped_rows.failure")):
        findings.append((Health.ALARM, "row-remap-failure", "row remapping failed: no spare rows left"))
    for xid in xids:
        findings.append((XID_HEALTH.get(xid, Health.WARNING), f"xid-{xid}", f"Xid {xid}"))
    if not findings:
        return DeviceReading(device, Health.OK)

    order = list(Health)  # OK, Warning, Alarm, Critical: worse later
    health = max((h for h, _, _ in findings), key=order.index)
    codes = tuple(dict.fromkeys(code for _, code, _ in findings))
    return DeviceReading(device, health, codes, "; ".join(text for _, _, text in findings))


class CudaBackend:
    """NVIDIA GPUs, read through NVML when it is there, else nvidia-smi."""

    kind = "cuda"
    visibility_var = "CUDA_VISIBLE_DEVICES"

    def __init__(self, options: DeviceOptions):
        self.options = options
        self._nvml = None  # the pynvml module once nvmlInit worked
        self._nvml_tried = False
        self._events = None  # NVML event set for critical Xids, when supported
        self._known: dict[str, int] = {}  # bus id -> index, to place a GPU that later becomes unreachable

    # -- the protocol ---------------------------------------------------------------------------------

    def discover(self) -> list[Device]:
        """The node's GPUs by index. Raises DeviceToolError."""
        return [reading.device for reading in self._readings(polling=False)]

    def reset(self, index: int) -> None:
        """``nvidia-smi --gpu-reset -i N`` (root, and no process on the GPU). Raises DeviceToolError."""
        args = [self.options.nvidia_smi, "--gpu-reset", "-i", str(index)]
        result = run_tool(args, self.options.reset_timeout, f"nvidia-smi --gpu-reset -i {index}", merge_stderr=True)
        if result.returncode != 0:
            first = next((line.strip() for line in result.stdout.splitlines() if line.strip()), "(no output)")
            raise DeviceToolError(f"nvidia-smi --gpu-reset -i {index} failed with exit code {result.returncode}: {first}")

    def poll(self) -> list[DeviceReading]:
        """Every GPU's health now. Raises DeviceToolError."""
        return self._readings(polling=True)

    def cpu_affinity(self) -> dict[int, frozenset[int]]:
        """GPU index -> the CPUs near it, from ``nvidia-smi topo -m``. Raises DeviceToolError."""
        code, out, err = self._run([self.options.nvidia_smi, "topo", "-m"])
        if code != 0:
            first = (err.strip() or out.strip()).splitlines()[:1]
            raise DeviceToolError(f"nvidia-smi topo -m exited with {code}" + (f": {first[0][:200]}" if first else ""))
        return parse_affinity_matrix(out, "GPU")

    # -- shared ---------------------------------------------------------------------------------------

    def _readings(self, polling: bool) -> list[DeviceReading]:
        """Discovery needs names and indices only; a poll also asks for row remapping and drains the Xids."""
        nvml = self._nvml_module()
        if nvml is not None:
            reader = _NvmlReader(nvml)
            return self._place(reader.rows(), reader.drain_xids(self._events) if polling else {})
        rows = self._smi_rows(GPU_FIELDS)
        if polling:
            _merge_remap(rows, self._remap_rows())
        return self._place(rows)

    def _place(self, rows: list[dict[str, str]], xids: Mapping[int, Sequence[int]] | None = None) -> list[DeviceReading]:
        """Statuses in index order; a row without an index gets its bus id's last index, else the lowest free one."""
        taken = {int(r["index"]) for r in rows if (r.get("index") or "").isdigit()}
        readings = []
        for row in rows:
            if not (row.get("index") or "").isdigit():
                index = self._known.get(bus_key(row.get("pci.bus_id") or ""))
                if index is None or index in taken:
                    index = min(i for i in range(len(rows) + len(taken) + 1) if i not in taken)
                taken.add(index)
                row = {**row, "index": str(index)}
            device = device_from_fields(row)
            if device.physical and not row.get(ERROR_FIELD):
                self._known[bus_key(device.physical)] = device.index
            readings.append(reading_from_fields(device, row, (xids or {}).get(device.index, ())))
        return sorted(readings, key=lambda s: s.device.index)

    # -- nvidia-smi -----------------------------------------------------------------------------------

    def _smi_rows(self, fields: Sequence[str]) -> list[dict[str, str]]:
        args = [self.options.nvidia_smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        code, out, err = self._run(args)
        # a GPU it cannot open is reported on either stream; other stderr lines are not data
        lost = "\n".join(line for line in err.splitlines() if _HANDLE_ERROR.search(line))
        try:
            rows = parse_nvidia_smi_csv(out + "\n" + lost, fields)
        except ValueError as e:
            if code == 0:
                raise DeviceToolError(f"'{' '.join(args)}' printed something unreadable: {e}") from None
            rows = []
        # nvidia-smi exits non-zero when one GPU is lost but still lists the others: keep what it said
        if code != 0 and not rows:
            first = (err.strip() or out.strip()).splitlines()[:1]
            raise DeviceToolError(f"'{' '.join(args)}' exited with {code}" + (f": {first[0][:200]}" if first else ""))
        return rows

    def _remap_rows(self) -> list[dict[str, str]]:
        args = [self.options.nvidia_smi, f"--query-remapped-rows={','.join(REMAP_FIELDS)}", "--format=csv,noheader,nounits"]
        try:
            code, out, _ = self._run(args)
            if code != 0:
                return []  # not supported by this GPU or driver: nothing to report
            return [r for r in parse_nvidia_smi_csv(out, REMAP_FIELDS) if ERROR_FIELD not in r]
        except (DeviceToolError, ValueError) as e:
            log.debug("row remapping unknown: %s", e)
            return []

    def _run(self, args: list[str]) -> tuple[int, str, str]:
        # named by the program and its query, without the long field list
        name = " ".join([os.path.basename(args[0]), *(a.split("=")[0] for a in args[1:2])])
        result = run_tool(args, self.options.timeout, name)
        return result.returncode, result.stdout, result.stderr

    # -- NVML -----------------------------------------------------------------------------------------

    def _nvml_module(self):
        if self._nvml_tried:
            return self._nvml
        self._nvml_tried = True
        try:
            import pynvml  # optional: nvidia-ml-py
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except Exception as e:  # NVMLError: no driver, no library; nvidia-smi will say more
            log.debug("NVML unavailable, using nvidia-smi: %s", e)
            return None
        self._nvml = pynvml
        self._events = _xid_event_set(pynvml)
        return pynvml


def _merge_remap(rows: list[dict[str, str]], remap: list[dict[str, str]]) -> None:
    by_bus = {bus_key(r["gpu_bus_id"]): r for r in remap}
    for row in rows:
        found = by_bus.get(bus_key(row.get("pci.bus_id") or ""))
        if found:
            row["remapped_rows.pending"] = found["remapped_rows.pending"]
            row["remapped_rows.failure"] = found["remapped_rows.failure"]


def _xid_event_set(nvml):
    """An event set registered for critical Xids on every GPU that supports it, or None."""
    try:
        events = nvml.nvmlEventSetCreate()
    except Exception as e:
        log.debug("NVML events unavailable: %s", e)
        return None
    try:
        count = nvml.nvmlDeviceGetCount()
    except Exception:
        count = 0
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
        except Exception as e:  # NotSupported on some GPUs (and in most VMs): no Xids for that one
            log.debug("no Xid events for GPU %d: %s", index, e)
    return events


class _NvmlReader:
    """One poll through NVML, in nvidia-smi's field names and words, so one function judges both."""

    def __init__(self, nvml):
        self.nvml = nvml

    def rows(self) -> list[dict[str, str]]:
        try:
            count = self.nvml.nvmlDeviceGetCount()
        except self.nvml.NVMLError as e:
            raise DeviceToolError(f"NVML nvmlDeviceGetCount failed: {e}") from None
        return [self._row(index) for index in range(count)]

    def _row(self, index: int) -> dict[str, str]:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as e:
            word = self._word(e)
            # only a lost GPU is a fault; any other refusal (permissions) leaves its health unknown to us
            return {"index": str(index), ERROR_FIELD: word} if _is_lost(word) else {"index": str(index)}

        def remapped(position: int):
            return lambda h: "Yes" if nvml.nvmlDeviceGetRemappedRows(h)[position] else "No"

        return {
            "index": str(index),
            "name": self._ask(nvml.nvmlDeviceGetName, handle),
            "pci.bus_id": self._ask(lambda h: nvml.nvmlDeviceGetPciInfo(h).busId, handle),
            "uuid": self._ask(nvml.nvmlDeviceGetUUID, handle),
            "ecc.errors.uncorrected.volatile.total": self._ask(
                lambda h: nvml.nvmlDeviceGetTotalEccErrors(
                    h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC),
                handle),
            "retired_pages.pending": self._ask(
                lambda h: "Yes" if nvml.nvmlDeviceGetRetiredPagesPendingStatus(h) else "No", handle),
            # (corrected rows, uncorrected rows, pending, failure)
            "remapped_rows.pending": self._ask(remapped(2), handle),
            "remapped_rows.failure": self._ask(remapped(3), handle),
        }

    def _ask(self, query, handle) -> str:
        try:
            value = query(handle)
        except self.nvml.NVMLError as e:
            return self._word(e)
        except (AttributeError, TypeError):  # a binding too old for this query
            return "[Not Supported]"
        return value.decode() if isinstance(value, bytes) else str(value)

    def _word(self, error) -> str:
        """nvidia-smi's word for an NVML error."""
        nvml = self.nvml
        value = getattr(error, "value", None)
        if value == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", 15):
            return "[GPU is lost]"
        if value == getattr(nvml, "NVML_ERROR_UNKNOWN", 999):
            return "[Unknown Error]"
        if value == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3):
            return "[Not Supported]"
        return "[N/A]"

    def drain_xids(self, events) -> dict[int, list[int]]:
        """Critical Xids since the last poll, by GPU index; waits for none. Each is reported once."""
        nvml = self.nvml
        found: dict[int, list[int]] = {}
        if events is None:
            return found
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        while True:
            try:
                data = wait(events, 0)
            except nvml.NVMLError:
                return found  # NVML_ERROR_TIMEOUT: nothing more (NotSupported: nothing ever)
            try:
                index = nvml.nvmlDeviceGetIndex(data.device)
            except nvml.NVMLError:
                continue
            found.setdefault(index, []).append(int(data.eventData))
