"""A stand-in for the parts of torch_npu 2.14.0 that ftrun's Ascend recovery drives: the HCCL process
group with its watchdog, and the device recovery calls (``stop_device``, ``restart_device``,
``check_uce_in_memory``). Each behaviour follows the released code, and its comment says where it is:
``_recovery.py`` and ``utils.py`` are the wheel's ``torch_npu/npu/`` files; the ``.cpp``/``.hpp`` files are
in the public Ascend/pytorch repository, ``torch_npu/csrc/`` (ProcessGroupHCCL in ``distributed/``,
``Module.cpp`` in ``npu/``, ``OptionsManager.cpp`` in ``core/npu/register/``), with the line numbers of its
master branch at commit 9e73e708 (August 2026), the snapshot that ASCEND.md's table was read from; the log
texts of those C++ paths (the FORCE STOP flag's, the rank table's world communicator's, the error-handling
variable's check) are also in the 2.14.0 wheel's ``libtorch_npu.so``.

One process's torch_npu is one :class:`TorchNpu`; ``install`` puts it where ``import torch_npu`` finds it.
The stand-in has no threads: where the real watchdog polls in a thread of its own, a test calls
:meth:`ProcessGroupHCCL.watchdog_tick` for one pass of its loop, and where the real watchdog's exception ends
the process, the pass raises :class:`ProcessTornDown`.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Callable, NamedTuple

#: the watchdog's states (WatchdogStatus, ProcessGroupHCCL.hpp:210; _recovery.py:10-11)
WATCHDOG_INIT, WATCHDOG_RUN, WATCHDOG_STOP = 0, 1, 2
#: TORCH_HCCL_ASYNC_ERROR_HANDLING's modes (ErrorHandlingMode, ProcessGroupHCCL.hpp:206); the modes that
#: take the process down (SHOULD_TEAR_DOWN, ProcessGroupHCCL.hpp:214)
NO_HANDLING, TEAR_DOWN, CLEAN_UP_ONLY, SKIP_CLEAN_UP = 0, 1, 2, 3
TEARS_DOWN = {TEAR_DOWN, SKIP_CLEAN_UP}


class ProcessTornDown(BaseException):
    """The process ended: a watchdog rethrew a communicator's error in its own thread (Watchdog::run,
    ProcessGroupHCCL.cpp:1903-1914), which terminates the process. A BaseException, so that nothing
    in the code under test catches it by accident."""


class Device(NamedTuple):
    """``torch.device`` as it is with torch_npu loaded (CPU torch knows no ``npu`` device type)."""

    type: str
    index: int | None = None


def async_error_handling() -> int:
    """The error-handling mode: TORCH_HCCL_ASYNC_ERROR_HANDLING, else the deprecated HCCL_ASYNC_ERROR_HANDLING,
    else 1, TearDown (OptionsManager.cpp:223-242). torch_npu reads it once per process and the stand-in at each
    group it builds, which comes to the same while a test leaves the environment alone."""
    value = os.environ.get("TORCH_HCCL_ASYNC_ERROR_HANDLING", os.environ.get("HCCL_ASYNC_ERROR_HANDLING", "1"))
    mode = int(value)
    if mode not in (NO_HANDLING, TEAR_DOWN, CLEAN_UP_ONLY, SKIP_CLEAN_UP):
        raise RuntimeError("TORCH_HCCL_ASYNC_ERROR_HANDLING should be 0, 1, 2, or 3.")  # OptionsManager.cpp:237
    return mode


class ProcessGroup:
    """The part of torch's c10d ``ProcessGroup`` that a group built by hand uses: one backend per device
    type. A group built so is in no ``_pg_map``: only ``init_process_group`` and ``new_group`` put one there."""

    class BackendType:
        CUSTOM = "CUSTOM"

    def __init__(self, store, rank: int, size: int):
        self._backends: dict[str, object] = {}

    def _set_default_backend(self, kind) -> None:
        self.default_backend = kind

    def _register_backend(self, device: Device, kind, backend) -> None:
        self._backends[device.type] = backend

    def _get_backend(self, device: Device):
        return self._backends[device.type]

    @property
    def _device_types(self) -> list[Device]:
        return [Device(kind) for kind in self._backends]

    def barrier(self, *args, **options):
        """A collective goes to the backend of the tensors' device (ftrun's tests use the npu one)."""
        return self._get_backend(Device("npu")).barrier(*args, **options)



class Work:
    """An enqueued collective, as the watchdog tracks it (WorkHCCL)."""

    def wait(self, timeout=None) -> bool:
        return True


def torch_pg_map() -> list:
    """The groups in torch's ``_pg_map`` (what _recovery.py:3 imports): those init_process_group and new_group made."""
    from torch.distributed.distributed_c10d import _pg_map

    return list(_pg_map)


class TorchNpu:
    """One process's torch_npu: its process-wide HCCL state, the device, and the groups built in it."""

    def __init__(self, pg_map: Callable[[], list] = torch_pg_map):
        #: torch's ``_pg_map``, the groups ``stop_device`` and ``restart_device`` walk (_recovery.py:81, 95)
        self.pg_map = pg_map
        #: file-static in ProcessGroupHCCL.cpp:100-101: shared by every group of the process
        self.device_error_msg = ""
        self.force_stop_error_flag = False
        #: ProcessGroupHCCL::global_ (ProcessGroupHCCL.cpp:521): the last group built without global ranks
        self.global_group: ProcessGroupHCCL | None = None
        #: the device's tasks were aborted (aclrtDeviceTaskAbort) and the device not restarted since
        self.device_stopped = False
        #: aclrtDeviceTaskAbort fails: stop_device returns 1
        self.abort_fails = False
        #: where the last fault hit the device's memory, as check_uce_in_memory answers it
        self.uce = 0
        #: _except_handler.force_stop_flag (torch_npu/utils/_error_code.py:106-114)
        self.python_force_stop = False
        #: every call of the recovery API, in order: (name, device)
        self.calls: list[tuple[str, int]] = []
        self.groups: list[ProcessGroupHCCL] = []
        self.npu = types.SimpleNamespace(stop_device=self.stop_device, restart_device=self.restart_device,
                                         check_uce_in_memory=self.check_uce_in_memory)
        hccl = self

        class BoundProcessGroupHCCL(ProcessGroupHCCL):
            owner = hccl

        self.ProcessGroupHCCL = BoundProcessGroupHCCL

    def install(self, monkeypatch) -> None:
        """``import torch_npu`` (and its C extension's distributed module) finds this process's stand-in,
        and ``torch.device("npu")`` works, as torch_npu's renaming of the private device type makes it."""
        c10d = types.SimpleNamespace(ProcessGroupHCCL=self.ProcessGroupHCCL)
        c_module = types.SimpleNamespace(_distributed_c10d=c10d)
        monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=self.npu, _C=c_module))
        monkeypatch.setitem(sys.modules, "torch_npu.npu", self.npu)
        monkeypatch.setitem(sys.modules, "torch_npu._C", c_module)
        monkeypatch.setitem(sys.modules, "torch_npu._C._distributed_c10d", c10d)
        monkeypatch.setattr("torch.device", Device)

    def _npu_groups(self):
        """The HCCL backends of the ``_pg_map`` groups whose device types hold npu (_recovery.py:80-83, 94-97)."""
        for group in self.pg_map():
            if Device("npu") in group._device_types:
                yield group._get_backend(Device("npu"))

    def stop_device(self, device_id: int) -> int:
        """_recovery.py:89-100: abort the device's tasks (Module.cpp:711-723: 0 when aclrtDeviceTaskAbort
        succeeds, else 1), set the Python-side force-stop flag, and pause the watchdog of ``_pg_map``'s npu
        groups only."""
        self.calls.append(("stop_device", device_id))
        result = 1 if self.abort_fails else 0
        self.device_stopped = True
        self.python_force_stop = True
        for backend in self._npu_groups():
            backend.set_watchdog_status(WATCHDOG_STOP)
        return result

    def restart_device(self, device_id: int, rebuild_all_resources: bool = False,
                       disable_tensor_unsafe_check: bool = False) -> None:
        """_recovery.py:59-86: restart the device, clear the Python-side force-stop flag, and clear the work
        list and resume the watchdog of ``_pg_map``'s npu groups only."""
        self.calls.append(("restart_device", device_id))
        self.device_stopped = False
        self.python_force_stop = False
        for backend in self._npu_groups():
            backend.clear_workmeta_list()
            backend.set_watchdog_status(WATCHDOG_RUN)

    def check_uce_in_memory(self, device_id: int) -> int:
        """Module.cpp:726-760: 0 no UCE, 1 outside torch_npu's memory pool, 2 in memory the pool frees (its
        cache emptied), 3 in memory the pool holds (an HBM multi-bit ECC error is always 3). The API
        reference ("(beta) torch_npu.npu.check_uce_in_memory") requires the caching allocator: with
        PYTORCH_NO_NPU_MEMORY_CACHING=1 there is no pool to look in, and the stand-in refuses."""
        self.calls.append(("check_uce_in_memory", device_id))
        if os.environ.get("PYTORCH_NO_NPU_MEMORY_CACHING") == "1":
            raise RuntimeError("check_uce_in_memory needs the memory cache: PYTORCH_NO_NPU_MEMORY_CACHING=1")
        return self.uce


class ProcessGroupHCCL:
    """torch_npu's HCCL backend: one watchdog per group, and the communicator made at the first collective."""

    #: the process's TorchNpu (set on the subclass each TorchNpu makes)
    owner: TorchNpu

    class Options:
        """ProcessGroupHCCL.Options (Init.cpp:447-454): defaults as torch_npu's constructor leaves them."""

        def __init__(self):
            self._timeout = None
            self.global_ranks_in_group: list[int] = []
            self.group_id = ""
            self.hccl_config: dict = {}

    def __init__(self, store, rank: int, size: int, options: "ProcessGroupHCCL.Options"):
        self.store, self.rank, self.size, self.options = store, rank, size, options
        #: the group's name is "group_name_" + group_id (ProcessGroupHCCL.cpp:1144-1145)
        self.group_name = "group_name_" + options.group_id
        self.async_error_handling = async_error_handling()  # ProcessGroupHCCL.cpp:1223-1224
        self.watchdog_status = WATCHDOG_INIT
        self.work_meta_list: list[Work] = []
        #: an error HcclGetCommAsyncError reports on this group's communicator (a peer's death, an error CQE)
        self.comm_async_error: str | None = None
        #: how the communicator was made: ("rank table", rank in the table), ("split", global ranks) or
        #: ("root info", rank); None until the first collective
        self.comm: tuple | None = None
        if not options.global_ranks_in_group:
            self.owner.global_group = self  # an empty list means "the world group" (ProcessGroupHCCL.cpp:1280-1281)
        self.owner.groups.append(self)

    def _make_comm(self) -> tuple:
        """createHCCLCommEx (ProcessGroupHCCL.cpp:2756-2808), then the store's root info (:2686-2720)."""
        table = os.environ.get("RANK_TABLE_FILE", "")
        if table and os.access(table, os.R_OK):
            if not self.options.global_ranks_in_group:
                # the whole world's communicator from the table, at the group's own rank (:2780-2791)
                return ("rank table", self.rank)
            if self.owner.global_group is not None:
                # split from the world group's communicator by the global ranks (:2811-2830, :2902-2903)
                return ("split", tuple(self.options.global_ranks_in_group))
        return ("root info", self.rank)

    def set_watchdog_status(self, status: int) -> None:
        """setWatchdogStatus (ProcessGroupHCCL.cpp:3636-3642): RUN also clears the process-wide error flags."""
        self.watchdog_status = status
        if status == WATCHDOG_RUN:
            self.owner.device_error_msg = ""
            self.owner.force_stop_error_flag = False

    def clear_workmeta_list(self) -> None:
        """clearWorkMetaList (ProcessGroupHCCL.cpp:3644-3647)."""
        self.work_meta_list.clear()

    def allreduce(self, *args, **options) -> Work:
        """Any collective: the communicator is made at the first, then workEnqueue (ProcessGroupHCCL.cpp:3425-3441)."""
        if self.comm is None:
            self.comm = self._make_comm()
        owner = self.owner
        if owner.device_error_msg:
            message, owner.device_error_msg = owner.device_error_msg, ""
            raise RuntimeError(f"{message} happened with workEnqueue.")
        if owner.force_stop_error_flag:
            owner.force_stop_error_flag = False  # one collective fails, the flag is spent
            raise RuntimeError("FORCE STOP.")
        work = Work()
        if self.watchdog_status != WATCHDOG_STOP:
            self.work_meta_list.append(work)
        return work

    barrier = allreduce

    def watchdog_tick(self) -> None:
        """One pass of Watchdog::runLoop (ProcessGroupHCCL.cpp:2069-2135)."""
        if self.watchdog_status == WATCHDOG_STOP:
            return  # a paused watchdog looks at nothing (:2098-2100)
        # checkHcclComms (:2022-2056): a communicator's error ends the process in a tearing-down mode
        if self.comm_async_error and self.async_error_handling in TEARS_DOWN:
            raise ProcessTornDown(f"HcclGetCommAsyncError: {self.comm_async_error}")
        if self.work_meta_list and self.owner.device_stopped:
            # a work's event query meets the aborted tasks' FORCE STOP (WorkHCCL::finishedNPUExecutionInternal,
            # :862-876): the process-wide flag fails the next collective of any group
            self.owner.force_stop_error_flag = True
            return
        self.work_meta_list.clear()  # the device ran them: done
