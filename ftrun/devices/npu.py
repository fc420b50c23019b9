"""Ascend NPUs, through ``npu-smi`` (and ``hccn_tool`` for device IPs).

A device is one chip (die): an A2 board has one per NPU, an A3 board two. The runtime counts
chips by *logic id* (``npu-smi info -m``), which inside a container that sees only some chips
differs from the NPU/chip numbers the table prints; hence the mapping, discovered once.
"""

from __future__ import annotations

import logging

from ftrun.devices import Device, DeviceOptions, DeviceReading, DeviceToolError, Health, npu_smi
from ftrun.devices.npu_smi import ChipRow, NpuSmi, ToolUnavailable
from ftrun.devices.topology import parse_affinity_matrix

log = logging.getLogger(__name__)
#: what npu-smi prints, in lower case, on a board that cannot reset a chip (npusmi_074)
RESET_REFUSAL = "does not support setting reset"


class NpuBackend:
    """The node's Ascend chips: discovered through ``npu-smi info -m``, polled through ``npu-smi info``."""

    kind = "npu"
    visibility_var = "ASCEND_RT_VISIBLE_DEVICES"

    def __init__(self, options: DeviceOptions):
        self.options = options
        self._smi = NpuSmi(options.npu_smi, options.timeout)
        #: (npu id, chip id) -> device, from the last discover()
        self._chips: dict[tuple[int, int], Device] | None = None
        #: logic id -> physical id, from the last table read
        self._phy_ids: dict[int, int] = {}

    def discover(self) -> list[Device]:
        """The node's compute chips, by logic id. Raises DeviceToolError."""
        try:
            mapping = {
                key: (chip.logic_id, chip.name)
                for key, chip in npu_smi.parse_mapping(self._smi.run("info", "-m")).items()
            }
        except ToolUnavailable:
            raise  # missing or hung: asking it again for -l would only fail again, slower
        except DeviceToolError as exc:
            # older npu-smi releases have no -m
            log.info("%s; counting chips from npu-smi info -l instead", exc)
            mapping = self._mapping_from_list()
        self._chips = {
            (npu, chip): Device(index=logic_id, name=name, physical=f"npu {npu} chip {chip}")
            for (npu, chip), (logic_id, name) in mapping.items()
        }
        return sorted(self._chips.values(), key=lambda d: d.index)

    def _mapping_from_list(self) -> dict[tuple[int, int], tuple[int, str]]:
        # without -m the runtime's count is the only guide: chips in NPU, then chip order
        chips = [(npu.npu, chip, npu.name) for npu in npu_smi.parse_list(self._smi.run("info", "-l"))
                 for chip in range(npu.chip_count)]
        return {(npu, chip): (logic_id, name) for logic_id, (npu, chip, name) in enumerate(chips)}

    def poll(self) -> list[DeviceReading]:
        """Every chip's health: one table read, plus a detail query per chip that is not OK."""
        if self._chips is None:
            self.discover()
        rows = {(row.npu, row.chip): row for row in npu_smi.parse_info_table(self._smi.run("info"))}
        readings = []
        detail_error: ToolUnavailable | None = None
        for key, device in sorted(self._chips.items(), key=lambda item: item[1].index):
            row = rows.get(key)
            if row is None:
                readings.append(DeviceReading(device, Health.UNKNOWN, info="missing from npu-smi info"))
                continue
            # A2 tables print no Phy-ID: one chip per NPU, and the NPU id is the physical id
            self._phy_ids[device.index] = row.phy_id if row.phy_id is not None else row.npu
            if row.health is Health.OK:
                readings.append(DeviceReading(device, Health.OK))
            elif detail_error is not None:
                # one hung detail query is enough: the next would only hang as long again
                readings.append(DeviceReading(device, row.health, info=str(detail_error)))
            else:
                try:
                    readings.append(self._detailed_reading(device, row))
                except DeviceToolError as exc:
                    # the table's verdict stands; the codes are a bonus
                    log.warning("%s: %s", device.physical, exc)
                    readings.append(DeviceReading(device, row.health, info=str(exc)))
                    if isinstance(exc, ToolUnavailable):
                        detail_error = exc
        return readings

    def _detailed_reading(self, device: Device, row: ChipRow) -> DeviceReading:
        chip = ("-c", str(row.chip)) if row.has_chip_id else ()
        output = self._smi.run("info", "-t", "health", "-i", str(row.npu), *chip)
        detail = npu_smi.parse_health(output)
        health = detail.health if detail.health is not Health.UNKNOWN else row.health
        return DeviceReading(device, health, detail.codes, detail.info)

    def _key_of(self, index: int) -> tuple[int, int]:
        """(npu id, chip id) of logic id ``index``."""
        if self._chips is None:
            self.discover()
        key = next((key for key, device in self._chips.items() if device.index == index), None)
        if key is None:
            raise DeviceToolError(f"no NPU chip with logic id {index}")
        return key

    def reset(self, index: int) -> None:
        """Reset one chip in band (``npu-smi set -t reset -i N -c C -m 1``). Raises DeviceToolError, also when
        npu-smi says the board does not support it: that refusal's exit code is not documented."""
        npu, chip = self._key_of(index)
        args = ("set", "-t", "reset", "-i", str(npu), "-c", str(chip), "-m", "1")
        output = NpuSmi(self.options.npu_smi, self.options.reset_timeout).run(*args)
        refusal = next((line.strip() for line in output.splitlines() if RESET_REFUSAL in line.lower()), None)
        if refusal is not None:
            raise DeviceToolError(f"npu-smi {' '.join(args)}: {refusal}")

    def reset_group(self, index: int) -> list[int]:
        """The logic ids reset together with ``index``: every chip of its NPU (an A3 NPU's two dies, a 300I
        Duo's two chips), as MindCluster resets a faulty chip with the chips associated with it."""
        npu, _ = self._key_of(index)
        return sorted(device.index for (other, _), device in self._chips.items() if other == npu)

    def cpu_affinity(self) -> dict[int, frozenset[int]]:
        """Logic id -> the CPUs near it, from ``npu-smi info -t topo`` (each chip of an NPU gets the
        NPU's row). Raises DeviceToolError."""
        if self._chips is None:
            self.discover()
        by_npu = parse_affinity_matrix(self._smi.run("info", "-t", "topo"), "NPU")
        return {device.index: by_npu[npu] for (npu, _), device in self._chips.items() if npu in by_npu}

    def physical_id(self, index: int) -> int:
        """The physical device id of logic id ``index`` (what hccn_tool and the HCCL rank table count in)."""
        if index not in self._phy_ids:
            self.poll()
        try:
            return self._phy_ids[index]
        except KeyError:
            raise DeviceToolError(f"no NPU chip with logic id {index} in npu-smi info") from None

    def device_ip(self, index: int) -> str:
        """The chip's RoCE IP from hccn_tool (on PATH or in the driver's tools folder), for the HCCL rank
        table; "" when hccn_tool is not installed."""
        if not npu_smi.find_hccn_tool(self.options.hccn_tool):
            return ""  # checked first: without the tool there is no reason to read npu-smi
        return npu_smi.hccn_device_ip(self.physical_id(index), self.options.hccn_tool, self.options.timeout)

    def super_pod_ids(self, index: int) -> tuple[int, int]:
        """The chip's super device id (SDID) and super pod id, on an A3 SuperPoD (``npu-smi info -t spod-info``).
        Raises DeviceToolError elsewhere: other boards do not support the query."""
        npu, chip = self._key_of(index)
        if len(self.reset_group(index)) < 2:
            # a SuperPoD's NPUs have two dies: a board with one chip per NPU need not be asked
            raise DeviceToolError(f"npu {npu} has one chip: not an A3 SuperPoD board")
        return npu_smi.parse_spod_info(self._smi.run("info", "-t", "spod-info", "-i", str(npu), "-c", str(chip)))
