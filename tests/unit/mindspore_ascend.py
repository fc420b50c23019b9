"""A stand-in for the parts of MindSpore 2.10 that a rank's process-level repair touches on Ascend:
``mindspore._c_expression``'s fault-tolerance calls, ``mindspore.communication``'s all-gather, and the
runtime behaviour behind them that no CPU build shows.

Each behaviour follows the released code, and its comment says where it is (files of the 2.10 wheel
under ``mindspore/``, or the public C++ source, whose names are all in the 2.10 ``.so``). Calls are
recorded in order, so that a test can check the sequence ftrun makes.

What it reads from the environment, as MindSpore does at import (``utils/utils.py``, the module-level
``TftHandle()``), is ``MS_ENABLE_TFT``: a test sets the variables the agent gives a worker first, then
builds the stand-in.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import types

import numpy as np

#: what the runtime raises for an on-chip memory error once UCE tagging is on (libmindspore_tools.so)
UCE_TEXT = "UCEError error occurs when execute, error_code=507053"
#: the same for an HBM multi-bit ECC error, which model.py:143 also treats as a UCE
HBM_ECC_TEXT = "UCEError error occurs when execute, error_code=507054"
#: the text with no error code, also in libmindspore_tools.so
UCE_BARE_TEXT = "UCEError occurs when execute."
#: what a step blocked when the device was stopped raises (libmindspore_tools.so)
FORCE_STOP_TEXT = "ForceStopError error occurs when execute"
#: the name of the parameter that MindSpore's fault-tolerant optimizer adds
#: (``TrainFaultTolerance.get_optimizer_wrapper``, train/callback/_train_fault_tolerance.py:843)
FLAG_NAME = "tft_g_one_flag"


class KilledByWatchdog(BaseException):
    """What the stand-in raises where MindSpore's HCCL watchdog would end the worker's process group."""


def parse_tft_config(text: str) -> dict[str, str]:
    """``MS_ENABLE_TFT`` as MindSpore reads it: braces stripped, ``KEY:VALUE`` items split on commas
    (utils/utils.py:82-92, and GetConfigMap in tools/error_handler/error_config.cc). ARF:1 also turns
    the HCCL watchdog off and TTP on (utils/utils.py:110-113)."""
    config: dict[str, str] = {}
    for item in text.replace("{", "").replace("}", "").strip().split(","):
        if item:
            key, value = item.split(":")
            config[key.strip()] = value.strip()
    if config.get("ARF") == "1":
        config["HCCL_WATCHDOG"] = "0"
        config["TTP"] = "1"
    return config


class Parameter:
    """A MindSpore Parameter as far as the repair reads it: a name and a value on the device."""

    def __init__(self, name: str, value):
        self.name = name
        self.value = np.asarray(value)


class AscendMindSpore:
    """MindSpore 2.10 on an Ascend rank, as far as ftrun's repair calls it (the module text says how
    each behaviour is sourced). ``rows`` is what the all-gather answers; ``uce_strategy`` is where an
    on-chip memory error hit, as the device would say once it gathered the error's address."""

    def __init__(self, monkeypatch, rows, uce_strategy="RS_UCE_HIGHLEVEL"):
        self.calls: list[tuple] = []
        self.rows = rows
        self.uce_strategy = uce_strategy
        self.config = parse_tft_config(os.environ.get("MS_ENABLE_TFT", ""))
        #: the device was stopped (``_stop_device``)
        self.stopped = threading.Event()
        #: the runtime's force-stop flag: set by the stop, cleared by ``_reset_error_state``
        self.force_stop = False
        #: a UCE was tagged in the step's error, so the device holds the error's address
        self.uce_tagged = False
        #: the ARF flag (``set_is_arf``) that marks the communication as rebuilt
        self.is_arf = False
        #: what MindSpore's HCCL watchdog did: the signals it sent to the worker's process group
        self.killpg: list[int] = []
        record = self._record
        c_expression = types.SimpleNamespace(
            _stop_device=self._stop_device,
            clean_tdt_channel=lambda: record("clean_tdt_channel"),
            _reset_snapshot_state=lambda: record("_reset_snapshot_state"),
            _finalize_comm=lambda: record("_finalize_comm"),
            _rebuild_group=lambda: record("_rebuild_group"),
            set_is_arf=self._set_is_arf,
            _reset_error_state=self._reset_error_state,
            _pre_launch_send_recv=lambda device: record("_pre_launch_send_recv", device),
            send_recv=lambda params, src, dst: record("send_recv", len(params), src, dst) or 0,
            CollectiveManager=types.SimpleNamespace(get_instance=lambda: types.SimpleNamespace(
                resume_hccl_comm=lambda: record("resume_hccl_comm"))),
            _get_uce_mem_info=lambda device: record("_get_uce_mem_info", device),
            _get_uce_process_strategy=self._get_uce_process_strategy,
            _repair_device=lambda device: record("_repair_device", device),
            # a host copy of a one-element parameter, which int() reads as it reads MindSpore's Tensor
            direct_copy_to_host=lambda parameter: parameter.value.reshape(()).copy(),
        )
        comm_func = types.SimpleNamespace(all_gather_into_tensor=self._all_gather)
        mindspore = types.SimpleNamespace(Tensor=np.asarray, int32=np.int32, _c_expression=c_expression,
                                          ops=types.SimpleNamespace(assign=self._assign),
                                          communication=types.SimpleNamespace(comm_func=comm_func))
        monkeypatch.setitem(sys.modules, "mindspore", mindspore)
        monkeypatch.setitem(sys.modules, "mindspore._c_expression", c_expression)
        monkeypatch.setitem(sys.modules, "mindspore.communication", mindspore.communication)

    # -- what MS_ENABLE_TFT switches on ---------------------------------------------------------------

    def enabled(self, key: str) -> bool:
        """A feature of MS_ENABLE_TFT is on when its value is "1" (IsEnableFeature, error_config.cc)."""
        return self.config.get(key) == "1"

    @property
    def watchdog(self) -> bool:
        """MindSpore's HCCL watchdog runs unless the config says HCCL_WATCHDOG 0 (IsEnableWatchdog and
        CheckSupport in error_config.cc: on by default)."""
        return self.config.get("HCCL_WATCHDOG", "") != "0"

    # -- the step, as the runtime ends it ---------------------------------------------------------------

    def blocked_collective(self, timeout: float = 5.0) -> None:
        """A step blocked in a collective whose peer is gone, until the device is stopped. With UCE or
        ARF on, the runtime turns the stop into a failed step (IsRunningFailed in the graph scheduler's
        ``actor_common.cc``, gated by TftConfig::IsEnableUCE/IsEnableARF). Otherwise the HCCL watchdog sees the
        communicator's error and, while TftConfig::IsEnableWatchdog holds, sends SIGTERM to the worker's
        process group (``HcclWatchDogHandler::WatchDogProcess``, ``hccl_watch_dog_thread.cc`` in the Ascend
        collective plugin), which ARF:1 turns off."""
        if not self.stopped.wait(timeout):
            raise TimeoutError("the stand-in's collective was never stopped")
        if self.enabled("UCE") or self.enabled("ARF"):
            raise RuntimeError(FORCE_STOP_TEXT)
        if self.watchdog:
            self.killpg.append(signal.SIGTERM)
        raise KilledByWatchdog()

    def memory_error(self, hbm_ecc: bool = False) -> RuntimeError:
        """What a step raises after an on-chip memory error. With UCE:1 the runtime tags it (the
        UCEError texts of libmindspore_tools.so) and keeps its address for the strategy; without it,
        the runtime's plain failure carries no tag and nothing is kept (its wording here is the stand-in's
        own: what matters is that it has no UCEError in it)."""
        if not self.enabled("UCE"):
            return RuntimeError("Sync stream failed, the device raised an exception")
        self.uce_tagged = True
        return RuntimeError(HBM_ECC_TEXT if hbm_ecc else UCE_TEXT)

    def optimizer_update_begins(self, flag: Parameter, world_size: int) -> None:
        """The fault-tolerant optimizer's first act: the flag is all-reduced (summed over the ranks) before
        the update, and stays so until the callback puts it back at the step's end
        (_train_fault_tolerance.py:845-850, 957-972)."""
        flag.value = np.asarray([world_size], dtype=np.int32)

    # -- _c_expression ---------------------------------------------------------------------------------

    def _record(self, *call):
        self.calls.append(call)

    def _stop_device(self, device: int) -> None:
        self._record("_stop_device", device)
        self.force_stop = True
        self.stopped.set()

    def _reset_error_state(self) -> None:
        """Clears the force-stop flag and the UCE tag (model.py:326 calls it before training resumes)."""
        self._record("_reset_error_state")
        self.force_stop = False
        self.uce_tagged = False

    def _set_is_arf(self, on: bool) -> None:
        self._record("set_is_arf", on)
        self.is_arf = on

    def _get_uce_process_strategy(self) -> str:
        """Where the UCE hit; with no address gathered (UCE tagging off), RS_NORMAL: nothing MindSpore
        manages (GetUceProcessStrategyForKbk's default)."""
        self._record("_get_uce_process_strategy")
        return self.uce_strategy if self.uce_tagged else "RS_NORMAL"

    def _assign(self, parameter: Parameter, value) -> None:
        parameter.value = np.asarray(value)

    def _all_gather(self, tensor):
        self.calls.append(("all_gather", tuple(int(x) for x in tensor[0])))
        return types.SimpleNamespace(asnumpy=lambda: np.array(self.rows)), None

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]
