"""MindSpore's own repair hooks on Ascend: the device and communication seam of a MindSpore rank's repair
(``ftrun/elastic/backends.py`` is a torch rank's). mindspore is imported by each call, never at import."""

from __future__ import annotations


class AscendHooks:
    """MindSpore's own repair hooks on Ascend, named for the repair's steps (what its fault-tolerance
    callback calls, in the same order). Every call goes through this one object, which tests replace
    underneath by faking ``mindspore._c_expression`` and ``mindspore.communication``."""

    def __init__(self, device_id: int):
        self.device_id = device_id

    def stop(self) -> None:
        """Abort the device's tasks: a step blocked in a collective raises."""
        from mindspore._c_expression import _stop_device

        _stop_device(self.device_id)

    def clean(self, online: bool = False) -> None:
        """After the stop: the data channel emptied; at the online level the communicators resumed as they
        are, else the snapshot state reset for the rebuild."""
        from mindspore._c_expression import _reset_snapshot_state, clean_tdt_channel

        clean_tdt_channel()
        if online:
            from mindspore._c_expression import CollectiveManager

            CollectiveManager.get_instance().resume_hccl_comm()
        else:
            _reset_snapshot_state()

    def uce_strategy(self) -> str:
        """Where an on-chip memory error (UCE) hit, as MindSpore names what to do about it (UCE_STRATEGIES)."""
        from mindspore._c_expression import _get_uce_mem_info, _get_uce_process_strategy

        _get_uce_mem_info(self.device_id)
        return str(_get_uce_process_strategy())

    def repair_device(self) -> None:
        """Repair the device's memory after a UCE, once the communication is back."""
        from mindspore._c_expression import _repair_device

        _repair_device(self.device_id)

    def rebuild(self) -> None:
        """Destroy the communication groups and make them again, with the replacement in them."""
        from mindspore._c_expression import _finalize_comm, _rebuild_group, set_is_arf

        _finalize_comm()
        _rebuild_group()
        set_is_arf(True)

    def reset_error_state(self) -> None:
        """Clear what the stop left in the runtime (its force-stop flag, a UCE's tag), so that steps run
        again: MindSpore's training loop calls it once a repair is done (``train/model.py:326``)."""
        from mindspore._c_expression import _reset_error_state

        _reset_error_state()

    def end_rebuild(self) -> None:
        """The first step after a rebuild ended: the ARF flag that :meth:`rebuild` raised comes down, as
        MindSpore's fault-tolerance callback lowers it at that step's end
        (``train/callback/_train_fault_tolerance.py:974-979``)."""
        from mindspore._c_expression import set_is_arf

        set_is_arf(False)

    def parameters_consistent(self, flag) -> bool:
        """Whether no optimizer update is under way: the fault-tolerant optimizer's flag reads 1, as
        ``TrainFaultTolerance._is_params_consistent`` reads it (``_train_fault_tolerance.py:791-796``)."""
        from mindspore._c_expression import direct_copy_to_host

        return int(direct_copy_to_host(flag)) == 1

    def mark_consistent(self, flag) -> None:
        """At a step's end, the flag back to 1: the optimizer sums it over the ranks as its update begins,
        and MindSpore's callback puts it back as each step ends (``_train_fault_tolerance.py:957-972``)."""
        import mindspore

        mindspore.ops.assign(flag, mindspore.Tensor([1], dtype=mindspore.int32))

    def prepare_transfers(self) -> None:
        from mindspore._c_expression import _pre_launch_send_recv

        _pre_launch_send_recv(self.device_id)

    def gather(self, row: list[int]) -> list[list[int]]:
        """Every rank's ``row``, by rank (an all-gather on the world group)."""
        import mindspore
        import numpy as np
        from mindspore.communication import comm_func

        gathered, _ = comm_func.all_gather_into_tensor(mindspore.Tensor(np.array([row], dtype=np.int64)))
        return [[int(x) for x in r] for r in gathered.asnumpy()]

    def send_recv(self, parameters: list, source: int, receiver: int) -> None:
        """The parameters from ``source`` to ``receiver``; both call it alike."""
        from mindspore._c_expression import send_recv

        if send_recv(parameters, source, receiver) != 0:
            raise RuntimeError(f"send_recv of the parameters from rank {source} to rank {receiver} failed")


#: what _get_uce_process_strategy answers, and whether the rank's training state is still good; any other
#: answer: the error is outside what MindSpore manages, and the process is replaced
UCE_STRATEGIES = {"RS_UCE_HIGHLEVEL": False, "RS_UCE_LOWLEVEL": True}
#: how a UCE shows in the error a rank's step raises: MindSpore's own texts once UCE:1 is on ("UCEError
#: error occurs when execute, error_code=507053", the same with 507054 for an HBM multi-bit ECC error,
#: which MindSpore also repairs as a UCE, and "UCEError occurs when execute."), and torch_npu's and ACL's
UCE_SIGNS = ("UCEError", "UCE ERROR", "507053", "507054")

#: the parameter that MindSpore's fault-tolerant optimizer adds to say whether its update is under way
#: (``TrainFaultTolerance.get_optimizer_wrapper``, ``_train_fault_tolerance.py:843``)
CONSISTENCY_FLAG = "tft_g_one_flag"


def consistency_flag(parameters: list):
    """Among a rank's parameters, the fault-tolerant optimizer's CONSISTENCY_FLAG, or None without one."""
    return next((p for p in parameters if CONSISTENCY_FLAG in p.name), None)
