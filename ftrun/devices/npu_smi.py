"""Reading Ascend's ``npu-smi`` and ``hccn_tool``: tolerant parsers and one small runner.

The parsers are pure (text in, values out) so every layout can be tested from a fixture. Real
tools differ in spacing and spelling between releases, so each parser splits on the layout's
separators, matches labels case-insensitively and skips lines it does not know. Anything it
cannot use becomes a :class:`DeviceToolError` with one line that names the command, never a
``ValueError`` or ``IndexError`` from deep inside.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

from ftrun.devices import DeviceToolError, Health
from ftrun.devices.tool import ToolUnavailable, run_tool

INFO = "npu-smi info"
HEALTH = "npu-smi info -t health"
LIST = "npu-smi info -l"
MAPPING = "npu-smi info -m"
SPOD_INFO = "npu-smi info -t spod-info"
HCCN_IP = "hccn_tool -ip -g"
#: where the Ascend driver installs hccn_tool; the vendor's docs run it from there, and it is usually not on PATH
DRIVER_HCCN_TOOL = "/usr/local/Ascend/driver/tools/hccn_tool"

_CODE = re.compile(r"(?:0x)?([0-9a-f]{8})", re.IGNORECASE)
# the wording differs between releases: "Invalid card id.", "Invalid chip id", "Error parameter of -i"
_REFUSAL = re.compile(r"^\s*(invalid\b.*\bid\b|error parameter\b)", re.IGNORECASE)
_ID = re.compile(r"[0-9]{1,9}")
_HEALTH_WORDS = {h.value.lower() for h in Health}


@dataclass(frozen=True)
class ChipRow:
    """One chip's two rows of the ``npu-smi info`` table."""

    npu: int
    chip: int
    name: str
    health: Health
    bus_id: str
    #: the board-wide physical id (A3 boards print it; A2 boards do not)
    phy_id: int | None = None
    #: whether the table printed a chip id: Ascend 950's does not, and its npu-smi takes no -c
    has_chip_id: bool = True


@dataclass(frozen=True)
class ChipHealth:
    """What ``npu-smi info -t health`` says about one chip."""

    health: Health
    #: error codes, 8 hex digits, upper case; empty for ``NA``
    codes: tuple[str, ...] = ()
    #: ``Error Information``, continuation lines joined with "; "; empty for ``NA``
    info: str = ""
    #: the chip id, when the output names it (the form without ``-c``)
    chip: int | None = None


@dataclass(frozen=True)
class ListedNpu:
    """One NPU of ``npu-smi info -l``."""

    npu: int
    chip_count: int = 1
    #: ``Product Name`` where older boards print it
    name: str = ""


@dataclass(frozen=True)
class LogicChip:
    """One compute chip of ``npu-smi info -m``."""

    logic_id: int
    name: str


def _int(text: str) -> int | None:
    # ASCII digits, bounded: int() takes "²" for no digit and refuses thousands of digits
    text = text.strip()
    return int(text) if _ID.fullmatch(text) else None


def _lines(text: str, command: str) -> list[str]:
    """The output's lines, after the checks every parser shares."""
    if not text.strip():
        raise DeviceToolError(f"{command} printed nothing")
    lines = text.splitlines()
    for line in lines:
        if _REFUSAL.match(line):
            raise DeviceToolError(f"{command} refused: {line.strip()}")
    return lines


def _label_value(line: str) -> tuple[str, str] | None:
    """``"  Error Code   : NA"`` -> ``("error code", "NA")``; label words normalised."""
    label, sep, value = line.partition(":")
    if not sep:
        return None
    return " ".join(label.split()).lower(), value.strip()


def parse_info_table(text: str) -> list[ChipRow]:
    """The chips of ``npu-smi info``, in table order; the process section is ignored.

    Three layouts are known. A2 and A3 put the NPU id and name in one cell (A3 adds a Phy-ID after the chip
    id). Atlas 300I/310P head that second number "Device", which is not a physical id. npu-smi 25.6 on
    Ascend 950 gives "NPU ID" a column of its own and leaves the chip row's first cells empty (one chip
    per NPU; the layout is known from one third-party sample only).
    """
    rows: list[ChipRow] = []
    pending: tuple[int, str, Health] | None = None  # the NPU row waiting for its chip row
    second_is_phy_id = True
    npu_id_column = False
    for line in _lines(text, INFO):
        lowered = line.lower()
        if "process id" in lowered or "no running processes found" in lowered:
            break  # process rows start with "npu chip" numbers too: they must not read as chips
        if not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        header = cells[0].lower().split()
        if header[:1] == ["chip"]:
            second_is_phy_id = "device" not in header
        elif header == ["npu", "id"]:
            npu_id_column = True
        if npu_id_column and len(cells) > 2:
            # fold the 950's NPU ID and Name columns into the one cell the other layouts print
            cells = [f"{cells[0]} {cells[1]}".strip(), *cells[2:]]
        words = cells[0].split()
        first = _int(words[0]) if words else None
        blank_chip_row = npu_id_column and not words and pending is not None  # the 950's: chip 0, no ids
        if first is None and not blank_chip_row:
            continue  # the title, the column headers
        # rows alternate NPU row, chip row; the health word tells them apart where a chip row is missing
        if first is not None and (pending is None or cells[1].lower() in _HEALTH_WORDS):
            pending = (first, " ".join(words[1:]), Health.parse(cells[1]))
        elif pending is not None:
            npu, name, health = pending
            phy_id = _int(words[1]) if len(words) > 1 and second_is_phy_id else None
            rows.append(ChipRow(npu, 0 if first is None else first, name, health, cells[1], phy_id, first is not None))
            pending = None
    if not rows:
        raise DeviceToolError(f"{INFO} printed no NPU rows")
    return rows


def _health_blocks(text: str, command: str) -> tuple[list[dict[str, Any]], bool]:
    """Label/value pairs grouped per chip; whether the output named its chips (``Chip ID``).

    A health word in a block that has one already starts a new block: the MCU block that follows the
    chips of ``-t health -i N`` has no ``Chip ID`` and must not overwrite the last chip's health.
    """
    blocks: list[dict[str, Any]] = [{}]
    named = False
    last_label = ""
    for line in _lines(text, command):
        stripped = line.strip()
        if stripped.startswith(":"):
            if last_label == "error information" and stripped[1:].strip():
                blocks[-1].setdefault("info", []).append(stripped[1:].strip())
            continue
        pair = _label_value(line)
        if pair is None:
            last_label = ""
            continue
        label, value = pair
        last_label = label
        if label == "chip id":
            named = True
            blocks.append({"chip": _int(value)})
        elif label in ("health status", "health"):
            if "health" in blocks[-1]:
                blocks.append({})
            blocks[-1]["health"] = Health.parse(value)
        elif label == "error code":
            blocks[-1]["codes"] = tuple(m.group(1).upper() for w in value.split() if (m := _CODE.fullmatch(w)))
        elif label == "error information":
            if value.upper() not in ("", "NA"):
                blocks[-1].setdefault("info", []).append(value)
    return [b for b in blocks if "health" in b], named


def _chip_health(block: dict[str, Any]) -> ChipHealth:
    return ChipHealth(block["health"], block.get("codes", ()), "; ".join(block.get("info", [])), block.get("chip"))


def parse_health(text: str) -> ChipHealth:
    """One chip's health from ``npu-smi info -t health -i N -c C``."""
    blocks, _ = _health_blocks(text, HEALTH)
    if len(blocks) != 1:
        found = "no health status" if not blocks else f"{len(blocks)} health statuses, expected one"
        raise DeviceToolError(f"{HEALTH} printed {found}")
    return _chip_health(blocks[0])


def parse_npu_health(text: str) -> list[ChipHealth]:
    """Every chip's health from ``npu-smi info -t health -i N`` (no ``-c``), each with its chip id."""
    blocks, named = _health_blocks(text, HEALTH)
    chips = [b for b in blocks if b.get("chip") is not None]  # the MCU block names no chip
    if not named or not chips:
        raise DeviceToolError(f"{HEALTH} printed no chip health")
    return [_chip_health(b) for b in chips]


def parse_list(text: str) -> list[ListedNpu]:
    """The NPUs of ``npu-smi info -l``, by NPU id; a board that prints no chip count has one chip per NPU."""
    found: list[dict[str, Any]] = []
    total = None
    for line in _lines(text, LIST):
        pair = _label_value(line)
        if pair is None:
            continue
        label, value = pair
        if label in ("total count", "card count", "npu count") and not found:
            total = _int(value)
        elif label in ("npu id", "card id") and _int(value) is not None:
            found.append({"npu": _int(value)})
        elif found and label == "chip count" and _int(value) is not None:
            found[-1]["chip_count"] = _int(value)
        elif found and label == "product name":
            found[-1]["name"] = value
    if not found and total != 0:
        raise DeviceToolError(f"{LIST} printed no NPU ids")
    return sorted((ListedNpu(**f) for f in found), key=lambda n: n.npu)


def parse_mapping(text: str) -> dict[tuple[int, int], LogicChip]:
    """``npu-smi info -m``: (npu id, chip id) -> logic id and name, compute chips only."""
    chips: dict[tuple[int, int], LogicChip] = {}
    saw_mcu = False
    name_column = 3  # newer A3 releases print a "Chip Phy-ID" column before the name
    for line in _lines(text, MAPPING):
        words = line.split()
        if "logic" in line.lower():
            name_column = 4 if "phy-id" in line.lower() else 3
        if len(words) <= name_column or _int(words[0]) is None or _int(words[1]) is None:
            continue  # the header, blank lines, anything else
        name = " ".join(words[name_column:])
        logic_id = _int(words[2])
        if logic_id is None or name.lower() == "mcu":
            saw_mcu = True  # the board's management chip: no logic id, runs no work
            continue
        chips[(int(words[0]), int(words[1]))] = LogicChip(logic_id, name)
    if not chips:
        raise DeviceToolError(f"{MAPPING} printed no compute chips" + (" (only Mcu rows)" if saw_mcu else ""))
    return chips


def parse_spod_info(text: str) -> tuple[int, int]:
    """``npu-smi info -t spod-info -i N -c C`` on an A3 SuperPoD: the chip's super device id (SDID) and its
    super pod id. The labels are assumed from DCMI's ``dcmi_spod_info`` (sdid, super_pod_id); no sample of
    the command's output was at hand."""
    found: dict[str, int | None] = {}
    for line in _lines(text, SPOD_INFO):
        pair = _label_value(line)
        if pair is not None and pair[0] in ("sdid", "super pod id"):
            found[pair[0]] = _int(pair[1])
    sdid, pod = found.get("sdid"), found.get("super pod id")
    if sdid is None or pod is None:
        raise DeviceToolError(f"{SPOD_INFO} printed no SDID and Super Pod ID")
    return sdid, pod


def parse_hccn_ip(text: str) -> str:
    """The device IP from ``hccn_tool -i N -ip -g`` (``ipaddr:A.B.C.D``)."""
    for line in _lines(text, HCCN_IP):
        pair = _label_value(line)
        if pair and pair[0] == "ipaddr":
            try:
                return str(ipaddress.ip_address(pair[1]))
            except ValueError:
                raise DeviceToolError(f"{HCCN_IP} printed an invalid address: {pair[1]!r}") from None
    raise DeviceToolError(f"{HCCN_IP} printed no ipaddr")


class NpuSmi:
    """Runs a device tool (``npu-smi``, ``hccn_tool``) with a deadline; every failure is one DeviceToolError."""

    def __init__(self, path: str = "npu-smi", timeout: float = 10.0):
        self.path = path
        self.timeout = timeout

    def _locate(self) -> str:
        found = shutil.which(self.path)
        if found:
            return found
        # which() skips files without the x bit: say so, rather than "not found"
        candidates = [self.path] if os.sep in self.path else [
            os.path.join(d, self.path) for d in os.environ.get("PATH", "").split(os.pathsep) if d]
        for candidate in candidates:
            if os.path.isfile(candidate):
                raise ToolUnavailable(f"{self.path} is not executable: {candidate}")
        where = "" if os.sep in self.path else " on PATH"
        raise ToolUnavailable(f"{self.path} not found{where}")

    def run(self, *args: str) -> str:
        """The tool's output (stdout and stderr) for ``args``; raises DeviceToolError."""
        command = " ".join([os.path.basename(self.path), *args])
        result = run_tool([self._locate(), *args], self.timeout, command, merge_stderr=True)
        if result.returncode != 0:
            first = next((line.strip() for line in result.stdout.splitlines() if line.strip()), "(no output)")
            how = (f"was killed by signal {-result.returncode}" if result.returncode < 0
                   else f"failed with exit code {result.returncode}")
            raise DeviceToolError(f"{command} {how}: {first}")
        return result.stdout


def find_hccn_tool(tool: str = "hccn_tool") -> str:
    """The hccn_tool to run: ``tool`` on PATH, else the driver's copy (DRIVER_HCCN_TOOL); "" when neither is there."""
    found = shutil.which(tool)
    if found:
        return found
    driver_copy = tool == os.path.basename(DRIVER_HCCN_TOOL)  # a name or path of the user's own is theirs alone
    if driver_copy and os.path.isfile(DRIVER_HCCN_TOOL) and os.access(DRIVER_HCCN_TOOL, os.X_OK):
        return DRIVER_HCCN_TOOL
    return ""


def hccn_device_ip(device: int, tool: str = "hccn_tool", timeout: float = 10.0) -> str:
    """The device IP hccn_tool reports for physical device ``device``; "" when hccn_tool is not installed."""
    path = find_hccn_tool(tool)
    if not path:
        return ""
    return parse_hccn_ip(NpuSmi(path, timeout).run("-i", str(device), "-ip", "-g"))
