"""Fault levels (MindCluster's vocabulary) and the table that assigns them.

The table is data: ``fault_levels.yaml`` beside this module, plus an optional
site file (``--fault-levels``) merged on top by :func:`load_fault_table`. Each
source that reports codes has a section of its own (:data:`CODE_SECTIONS`), so a
new source is a row there and a section in the file, not a branch here. Below
ftrun's rows come the vendors' own lists (:data:`VENDOR_LISTS`, shipped as data
files that name their source and version): a code ftrun does not list takes the
vendor's level before the health word is consulted.
:class:`FaultTable` decides a level for a device's reading or a worker's last
output; :class:`Escalation` isolates a device that keeps needing repairs.
Nothing here reads a clock or runs a process.
"""

from __future__ import annotations

import enum
import functools
import importlib.resources
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import yaml

from ftrun.config import check_known_keys, parse_yaml_mapping, read_yaml_mapping
from ftrun.devices import DeviceReading, Health
from ftrun.errors import UsageError

#: the file's sections, in the order a complaint lists them: each source's codes (CODE_SECTIONS), the
#: health word for codes no section lists, a failed worker's messages, and when to escalate
SECTIONS = ("codes", "health", "cuda", "errors", "escalation")
ESCALATION_KEYS = ("window_hours", "repairs", "levels")
PACKAGED_NAME = "fault_levels.yaml"
#: what decided a level when no table lists the device's codes (or it printed none)
HEALTH_FALLBACK = "health fallback"


class FaultLevel(enum.Enum):
    """How bad a fault is, and so what ftrun does about it; members run from least to most severe."""

    #: L1, informational: log it, change nothing
    NOT_HANDLE = "NotHandleFault"
    #: degraded but working: log it (a site may choose to migrate)
    SUB_HEALTH = "SubHealthFault"
    #: keep the ranks there running, but place no new rank on the device
    PRE_SEPARATE = "PreSeparateNPU"
    #: L2, retry the request or step: process-level repair of the ranks on the device
    RESTART_REQUEST = "RestartRequest"
    #: L3, re-execute the business (an on-chip memory UCE): redo the step or reload from a replica
    RESTART_BUSINESS = "RestartBusiness"
    #: L4, repair the ranks now and reset the chip before it is used again
    FREE_RESTART = "FreeRestartNPU"
    #: L5, stop the ranks on the device, reset the chip, respawn them
    RESTART_NPU = "RestartNPU"
    #: L6, isolate the device; its ranks move to a free device or a spare node
    SEPARATE = "SeparateNPU"

    @property
    def severity(self) -> int:
        """0 for the mildest level, rising with severity."""
        return _SEVERITY[self]

    @classmethod
    def parse(cls, name: str) -> "FaultLevel":
        """A level from MindCluster's name (``RestartNPU``), ours (``RESTART_NPU``) or L1..L6; any case."""
        found = _NAMES.get(str(name).strip().lower())
        if found is None:
            raise ValueError(f"unknown fault level '{name}' (choose one of {', '.join(m.value for m in cls)})")
        return found


_SEVERITY = {level: rank for rank, level in enumerate(FaultLevel)}
_NAMES = {
    **{level.value.lower(): level for level in FaultLevel},
    **{level.name.lower(): level for level in FaultLevel},
    "l1": FaultLevel.NOT_HANDLE, "nothandle": FaultLevel.NOT_HANDLE,
    "l2": FaultLevel.RESTART_REQUEST,
    "l3": FaultLevel.RESTART_BUSINESS,
    "l4": FaultLevel.FREE_RESTART,
    "l5": FaultLevel.RESTART_NPU,
    "l6": FaultLevel.SEPARATE,
}
#: what ftrun does about a device at each level (shown by ``ftrun probe`` and in the logs)
ACTIONS = {
    None: "none",
    FaultLevel.NOT_HANDLE: "log only",
    FaultLevel.SUB_HEALTH: "log only (sub-health)",
    FaultLevel.PRE_SEPARATE: "keep its ranks; place no new rank on it",
    FaultLevel.RESTART_REQUEST: "process-level repair of its ranks",
    FaultLevel.RESTART_BUSINESS: "process-level repair of its ranks",
    FaultLevel.FREE_RESTART: "repair its ranks; reset the chip before reuse",
    FaultLevel.RESTART_NPU: "stop its ranks, reset the chip, respawn them",
    FaultLevel.SEPARATE: "isolate it; move its ranks to a free device, else a spare node",
}
#: levels at which the ranks on the device are stopped and replaced
REPAIR_LEVELS = frozenset({
    FaultLevel.RESTART_REQUEST, FaultLevel.RESTART_BUSINESS, FaultLevel.FREE_RESTART, FaultLevel.RESTART_NPU,
    FaultLevel.SEPARATE,
})

#: what ``health:`` may map a Health to, besides a level
_HEALTHY_WORDS = ("none", "ok", "healthy")


def most_severe(levels: Iterable[FaultLevel]) -> FaultLevel | None:
    """The most severe of ``levels`` (None when there are none)."""
    return max(levels, key=lambda level: level.severity, default=None)


@dataclass(frozen=True)
class Verdict:
    """What the table made of one device's reading or one worker's output."""

    #: None: healthy
    level: FaultLevel | None
    #: the code, health or message that decided it ("code 80E01801", "health Alarm", "UCE ERROR")
    reason: str
    #: for a device, the rule that gave the level: the table file that lists the code, the vendor list
    #: ("MindCluster faultCode.json v26.1.0"), or HEALTH_FALLBACK
    rule: str = ""


@dataclass(frozen=True)
class EscalationRule:
    """A device needing one of ``levels`` ``repairs`` times within ``window_hours`` is isolated."""

    window_hours: float = 24.0
    repairs: int = 2
    levels: frozenset[FaultLevel] = frozenset({FaultLevel.RESTART_NPU, FaultLevel.RESTART_BUSINESS})


def ascend_code(code: Any) -> str:
    """The table's spelling of an Ascend error code: 8 hex digits, upper case."""
    return str(code).strip().upper()


def cuda_code(code: Any) -> str:
    """The table's spelling of an NVIDIA finding: ``79``, ``xid 79``, ``XID_79`` all become ``xid-79``."""
    text = re.sub(r"[\s_]+", "-", str(code).strip().lower())
    return f"xid-{text}" if text.isdigit() else text


@dataclass(frozen=True)
class CodeSection:
    """The codes one source reports, as a section of the fault table lists them."""

    #: the source that reports them: a device backend's kind (``npu``, ``cuda``)
    source: str
    #: its section of fault_levels.yaml
    section: str
    #: one spelling for every way the source (or a site's file) writes a code
    spell: Callable[[Any], str]
    #: what a spelled code must look like (a regex; "" takes any), and what the file is told when it does not
    form: str = ""
    misformed: str = ""


#: every source whose codes the table lists, in the order a code is looked up (a device's reading does not
#: say which tool read it, and no two sources spell a code alike)
CODE_SECTIONS = (
    CodeSection("npu", "codes", ascend_code, r"[0-9A-F]{8}", "is not 8 hex digits (quote codes in YAML)"),
    CodeSection("cuda", "cuda", cuda_code),
)


@dataclass(frozen=True)
class VendorList:
    """A vendor's own list of codes and levels, consulted for the codes ftrun's table does not list."""

    #: the source whose codes it lists (a CODE_SECTIONS source)
    source: str
    #: the list's name and version, as a verdict cites it
    name: str
    #: codes as the source's section spells them -> level
    codes: Mapping[str, FaultLevel]


#: the vendor lists shipped beside this module, in lookup order (data files: ``name``, ``version``, ``codes``)
VENDOR_LISTS = (("npu", "mindcluster_fault_codes.yaml"),)


@dataclass(frozen=True)
class FaultTable:
    """Codes, health words and error messages mapped to fault levels; build it with :func:`load_fault_table`."""

    #: source (CODE_SECTIONS) -> its codes as the table spells them -> level: Ascend error codes (``npu``),
    #: NVIDIA findings such as ``gpu-lost``, ``xid-79`` (``cuda``)
    codes: Mapping[str, Mapping[str, FaultLevel]]
    #: a device's health -> level, for codes the table lacks (None: healthy)
    health: Mapping[Health, FaultLevel | None]
    #: message substrings -> level, in the file's order
    errors: tuple[tuple[str, FaultLevel], ...]
    #: when a device that keeps needing repairs is isolated
    escalation: EscalationRule = field(default_factory=EscalationRule)
    #: the files it was read from, packaged one first
    files: tuple[str, ...] = ()
    #: source -> code -> the file whose row gave it its level (the packaged table or the site's)
    code_files: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: the vendors' lists, consulted after ftrun's rows
    vendor_lists: tuple[VendorList, ...] = ()

    def level_of_code(self, code: str) -> FaultLevel | None:
        """The level ftrun's rows, else a vendor's list, give ``code``; None when none lists it."""
        found = self.lookup_code(code)
        return found[0] if found else None

    def lookup_code(self, code: str) -> tuple[FaultLevel, str] | None:
        """``code``'s level and the rule that gives it (a table file, a vendor list), or None."""
        for section in CODE_SECTIONS:
            spelled = section.spell(code)
            found = self.codes.get(section.source, {}).get(spelled)
            if found is not None:
                return found, self.code_files.get(section.source, {}).get(spelled, "")
        for vendor in self.vendor_lists:
            spelled = next(s.spell(code) for s in CODE_SECTIONS if s.source == vendor.source)
            if spelled in vendor.codes:
                return vendor.codes[spelled], vendor.name
        return None

    def level_of_health(self, health: Health) -> FaultLevel | None:
        """The level for a device judged by its health alone (None: healthy)."""
        if health in self.health:
            return self.health[health]
        return None if health is Health.OK else FaultLevel.SEPARATE

    def classify_device(self, reading: DeviceReading) -> Verdict:
        """The level a device's reading calls for: the most severe of its codes, else its health.

        A code that no table lists is judged by the health word (``health:``); the packaged table maps
        Alarm and Critical to RestartNPU there, so such a chip is reset first and isolated only when
        the reset does not bring it back.
        """
        by_health = self.level_of_health(reading.health)
        found: list[Verdict] = []
        for code in reading.codes:
            listed = self.lookup_code(code)
            if listed is not None:
                found.append(Verdict(listed[0], f"code {code}", listed[1]))
            else:
                # a code nobody listed still deserves a log line on an otherwise healthy device
                found.append(Verdict(by_health or FaultLevel.NOT_HANDLE,
                                     f"code {code} (in no fault table; health {reading.health.value})",
                                     HEALTH_FALLBACK))
        if not found:
            return Verdict(by_health, f"health {reading.health.value}", HEALTH_FALLBACK)
        return max(found, key=lambda v: v.level.severity)  # max keeps the first of equals

    def classify_text(self, lines: Iterable[str]) -> Verdict | None:
        """The most severe error message found in ``lines`` (case-insensitive), or None."""
        best: Verdict | None = None
        for line in lines:
            for text, level in self.errors:
                if (best is None or level.severity > best.level.severity) and _matcher(text).search(line):
                    best = Verdict(level, text)
        return best


@functools.lru_cache(maxsize=None)
def _matcher(text: str) -> re.Pattern:
    # a numeric code (an ACL error number) must not match inside a longer number
    if text.isdigit():
        return re.compile(rf"(?<!\d){text}(?!\d)")
    return re.compile(re.escape(text), re.IGNORECASE)


# -- loading -----------------------------------------------------------------------------------------


class _TableLoader(yaml.SafeLoader):
    """Plain scalars stay text: a code like 80E01801 or 00000001 must not become a number."""


_TableLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool",
                           "tag:yaml.org,2002:timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def load_fault_table(override_path: str | None = None) -> FaultTable:
    """The packaged fault table, with the entries of ``override_path`` (same shape) merged on top.

    Raises UsageError naming the file when the override cannot be read or makes no sense.
    """
    resource = importlib.resources.files("ftrun.detection").joinpath(PACKAGED_NAME)
    packaged = f"ftrun/detection/{PACKAGED_NAME}"
    shape = f"a mapping with keys {', '.join(SECTIONS)}"
    merged = _check(parse_yaml_mapping(resource.read_text(encoding="utf-8"), _TableLoader, f"fault table {packaged}",
                                       shape), packaged)
    files = [packaged]
    code_files = {s.source: dict.fromkeys(merged[s.section], packaged) for s in CODE_SECTIONS}
    if override_path:
        override = _check(read_yaml_mapping(override_path, _TableLoader, "fault table", shape), override_path)
        for section in SECTIONS:
            merged[section].update(override[section])
        for s in CODE_SECTIONS:
            code_files[s.source].update(dict.fromkeys(override[s.section], override_path))
        files.append(override_path)
    rule = merged["escalation"]
    return FaultTable(
        codes=MappingProxyType({s.source: MappingProxyType(merged[s.section]) for s in CODE_SECTIONS}),
        health=MappingProxyType(merged["health"]),
        errors=tuple(merged["errors"].items()),
        escalation=EscalationRule(
            window_hours=rule.get("window_hours", EscalationRule.window_hours),
            repairs=rule.get("repairs", EscalationRule.repairs),
            levels=rule.get("levels", EscalationRule().levels),
        ),
        files=tuple(files),
        code_files=MappingProxyType({source: MappingProxyType(found) for source, found in code_files.items()}),
        vendor_lists=tuple(_load_vendor_list(source, name) for source, name in VENDOR_LISTS),
    )


@functools.lru_cache(maxsize=None)
def _load_vendor_list(source: str, name: str) -> VendorList:
    """A packaged vendor list; a malformed one is ftrun's bug, so it fails loudly."""
    section = next(s for s in CODE_SECTIONS if s.source == source)
    text = importlib.resources.files("ftrun.detection").joinpath(name).read_text(encoding="utf-8")
    data = yaml.load(text, Loader=_TableLoader)
    codes = {}
    for code, level in data["codes"].items():
        spelled = section.spell(code)
        if section.form and not re.fullmatch(section.form, spelled):
            raise ValueError(f"ftrun/detection/{name}: code '{code}' {section.misformed}")
        codes[spelled] = FaultLevel.parse(level)
    return VendorList(source, f"{data['name']} {data['version']}", MappingProxyType(codes))


def _check(data: dict, where: str) -> dict[str, dict]:
    """Every section of one file, validated and normalised; absent sections are empty."""
    check_known_keys([str(k) for k in data], SECTIONS, f"fault table {where}")
    sections = {}
    for section in SECTIONS:
        value = data.get(section)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise UsageError(f"fault table {where}: '{section}' must be a mapping, not {_kind(value)}")
        sections[section] = value

    def level(value: Any, entry: str, healthy_ok: bool = False) -> FaultLevel | None:
        if healthy_ok and (value is None or str(value).strip().lower() in _HEALTHY_WORDS):
            return None
        if not isinstance(value, str):
            raise UsageError(f"fault table {where}: {entry} must be a level name, not {_kind(value)}")
        try:
            return FaultLevel.parse(value)
        except ValueError as e:
            raise UsageError(f"fault table {where}: {entry}: {e}") from None

    codes: dict[str, dict] = {}
    for source in CODE_SECTIONS:
        listed = codes[source.section] = {}
        for code, value in sections[source.section].items():
            spelled = source.spell(code)
            if source.form and not re.fullmatch(source.form, spelled):
                raise UsageError(f"fault table {where}: code '{code}' {source.misformed}")
            listed[spelled] = level(value, f"{source.section}.{spelled}")

    health = {}
    for word, value in sections["health"].items():
        match = next((h for h in Health if h.value.lower() == str(word).strip().lower()), None)
        if match is None:
            raise UsageError(f"fault table {where}: unknown health '{word}' "
                             f"(choose one of {', '.join(h.value for h in Health)})")
        health[match] = level(value, f"health.{match.value}", healthy_ok=True)

    errors = {}
    for text, value in sections["errors"].items():
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"fault table {where}: errors: '{text}' must be a non-empty string")
        errors[text] = level(value, f"errors.'{text}'")

    return {**codes, "health": health, "errors": errors,
            "escalation": _check_escalation(sections["escalation"], where, level)}


def _check_escalation(raw: dict, where: str, level) -> dict[str, Any]:
    check_known_keys([str(k) for k in raw], ESCALATION_KEYS, f"fault table {where} (escalation)")
    rule: dict[str, Any] = {}
    if "window_hours" in raw:
        try:
            hours = float(raw["window_hours"])
        except (TypeError, ValueError):
            hours = float("nan")
        if not hours > 0:  # also catches nan
            raise UsageError(f"fault table {where}: escalation.window_hours must be a positive number of hours, "
                             f"not '{raw['window_hours']}'")
        rule["window_hours"] = hours
    if "repairs" in raw:
        text = str(raw["repairs"]).strip()
        if not text.isdigit() or int(text) < 1:
            raise UsageError(f"fault table {where}: escalation.repairs must be a whole number of at least 1, "
                             f"not '{raw['repairs']}'")
        rule["repairs"] = int(text)
    if "levels" in raw:
        names = raw["levels"]
        if not isinstance(names, list):
            raise UsageError(f"fault table {where}: escalation.levels must be a list of level names, not {_kind(names)}")
        rule["levels"] = frozenset(level(name, "escalation.levels") for name in names)
    return rule


def _kind(value: Any) -> str:
    if value is None:
        return "empty"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"'{value}'"


class Escalation:
    """Counts each device's repairs over a sliding window; pure apart from that memory."""

    def __init__(self, rule: EscalationRule):
        self.rule = rule
        self._repairs: dict[int, list[float]] = {}

    @classmethod
    def from_table(cls, table: FaultTable) -> "Escalation":
        """An escalation by the table's ``escalation:`` settings."""
        return cls(table.escalation)

    def record(self, device_index: int, level: FaultLevel, now: float) -> FaultLevel:
        """``level``, or SEPARATE when this repair (at ``now``, seconds) makes ``repairs`` within the window."""
        if level not in self.rule.levels:
            return level
        window = self.rule.window_hours * 3600.0
        recent = [t for t in self._repairs.get(device_index, ()) if now - t <= window]
        recent.append(now)
        self._repairs[device_index] = recent
        return FaultLevel.SEPARATE if len(recent) >= self.rule.repairs else level
