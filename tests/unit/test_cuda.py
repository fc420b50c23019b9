"""NVIDIA GPUs through nvidia-smi: its CSV, the health each finding means, and the backend's handling of the tool."""

from __future__ import annotations

import os
import stat
import textwrap

import pytest

from ftrun.devices import Device, DeviceOptions, DeviceReading, DeviceToolError, Health
from ftrun.devices.cuda import GPU_FIELDS, REMAP_FIELDS, CudaBackend, parse_nvidia_smi_csv, reading_from_fields

# index, name, pci.bus_id, uuid, ecc.errors.uncorrected.volatile.total, retired_pages.pending
HEALTHY = "0, NVIDIA H100 80GB HBM3, 00000000:19:00.0, GPU-aaaa, 0, No\n"
MIXED = textwrap.dedent("""\
    0, NVIDIA H100 80GB HBM3, 00000000:19:00.0, GPU-aaaa, 0, No
    1, NVIDIA H100 80GB HBM3, 00000000:3B:00.0, GPU-bbbb, 3, No
    2, NVIDIA H100 80GB HBM3, 00000000:4C:00.0, GPU-cccc, [N/A], Yes
    3, Tesla T4, 00000000:5D:00.0, GPU-dddd, [Not Supported], [Not Supported]
    4, NVIDIA H100 80GB HBM3, 00000000:9B:00.0, GPU-eeee, [GPU is lost], [GPU is lost]
""")


def device(index=0):
    return Device(index, "NVIDIA H100 80GB HBM3", "00000000:19:00.0")


def fields(**values):
    row = dict(zip(GPU_FIELDS, ["0", "NVIDIA H100 80GB HBM3", "00000000:19:00.0", "GPU-aaaa", "0", "No"]))
    row.update({k.replace("__", "."): v for k, v in values.items()})
    return row


def test_parse_one_healthy_gpu():
    assert parse_nvidia_smi_csv(HEALTHY) == [{
        "index": "0", "name": "NVIDIA H100 80GB HBM3", "pci.bus_id": "00000000:19:00.0", "uuid": "GPU-aaaa",
        "ecc.errors.uncorrected.volatile.total": "0", "retired_pages.pending": "No",
    }]


def test_parse_keeps_bracketed_words_as_written():
    rows = parse_nvidia_smi_csv(MIXED)
    assert [r["index"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert rows[1]["ecc.errors.uncorrected.volatile.total"] == "3"
    assert rows[2]["ecc.errors.uncorrected.volatile.total"] == "[N/A]"
    assert rows[3]["retired_pages.pending"] == "[Not Supported]"
    assert rows[4]["uuid"] == "GPU-eeee" and rows[4]["retired_pages.pending"] == "[GPU is lost]"


def test_parse_skips_blank_lines():
    assert len(parse_nvidia_smi_csv("\n" + HEALTHY + "\n\n")) == 1


@pytest.mark.parametrize("line, expected", [
    ("Unable to determine the device handle for GPU0000:08:00.0: Unknown Error",
     {"error": "Unknown Error", "pci.bus_id": "0000:08:00.0"}),
    ("Unable to determine the device handle for GPU1: 0000:34:00.0: Unknown Error",
     {"error": "Unknown Error", "pci.bus_id": "0000:34:00.0", "index": "1"}),
    ("Unable to determine the device handle for GPU 2: GPU is lost.  Reboot the system to recover this GPU",
     {"error": "GPU is lost.  Reboot the system to recover this GPU", "index": "2"}),
])
def test_parse_unreachable_gpu_line(line, expected):
    assert parse_nvidia_smi_csv(line) == [expected]


def test_parse_rejects_a_line_with_the_wrong_number_of_values():
    with pytest.raises(ValueError, match="expected 6 values, got 2"):
        parse_nvidia_smi_csv("0, NVIDIA H100\n")


def test_parse_remapped_rows_query():
    rows = parse_nvidia_smi_csv("00000000:19:00.0, 0, 0\n00000000:3B:00.0, 1, 0\n", REMAP_FIELDS)
    assert rows[1] == {"gpu_bus_id": "00000000:3B:00.0", "remapped_rows.pending": "1", "remapped_rows.failure": "0"}


@pytest.mark.parametrize("values, health, codes", [
    ({}, Health.OK, ()),
    ({"ecc.errors.uncorrected.volatile.total": "[N/A]", "retired_pages.pending": "[Not Supported]"}, Health.OK, ()),
    ({"ecc.errors.uncorrected.volatile.total": "2"}, Health.ALARM, ("ecc-uncorrected",)),
    ({"retired_pages.pending": "Yes"}, Health.ALARM, ("retired-pages-pending",)),
    ({"remapped_rows.pending": "1"}, Health.ALARM, ("retired-pages-pending",)),
    ({"remapped_rows.pending": "No", "remapped_rows.failure": "Yes"}, Health.ALARM, ("row-remap-failure",)),
    ({"ecc.errors.uncorrected.volatile.total": "1", "retired_pages.pending": "Yes"}, Health.ALARM,
     ("ecc-uncorrected", "retired-pages-pending")),
    ({"ecc.errors.uncorrected.volatile.total": "[GPU is lost]"}, Health.CRITICAL, ("gpu-lost",)),
    ({"retired_pages.pending": "[Unknown Error]"}, Health.CRITICAL, ("gpu-lost",)),
    ({"error": "Unknown Error"}, Health.CRITICAL, ("gpu-lost",)),
])
def test_health_of_fields(values, health, codes):
    status = reading_from_fields(device(), fields(**values))
    assert (status.health, status.codes) == (health, codes)
    assert status.device == device()


def test_lost_gpu_info_names_the_drivers_words():
    status = reading_from_fields(device(), {"index": "0", "error": "GPU is lost"})
    assert status.info == "GPU is not reachable: GPU is lost"


@pytest.mark.parametrize("xids, health, codes", [
    ((79,), Health.CRITICAL, ("xid-79",)),
    ((48,), Health.ALARM, ("xid-48",)),
    ((13,), Health.WARNING, ("xid-13",)),
    ((13, 79), Health.CRITICAL, ("xid-13", "xid-79")),
])
def test_health_of_critical_xids(xids, health, codes):
    status = reading_from_fields(device(), fields(), xids)
    assert (status.health, status.codes) == (health, codes)


def test_ecc_count_is_in_the_info():
    status = reading_from_fields(device(), fields(**{"ecc.errors.uncorrected.volatile.total": "3"}))
    assert status.info == "3 uncorrected ECC errors since the driver loaded"


# -- the backend against a stand-in nvidia-smi --------------------------------------------------------


def fake_smi(tmp_path, gpu_output: str, remap_output: str = "", code: int = 0, remap_code: int = 0,
             sleep: float = 0) -> str:
    """An executable that prints like nvidia-smi for each of the two queries the backend makes."""
    (tmp_path / "gpu.txt").write_text(gpu_output)
    (tmp_path / "remap.txt").write_text(remap_output)
    script = tmp_path / "nvidia-smi"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        {f"exec sleep {sleep}" if sleep else ""}
        case "$1" in
          --query-gpu=*) cat "{tmp_path}/gpu.txt"; exit {code} ;;
          --query-remapped-rows=*) cat "{tmp_path}/remap.txt"; exit {remap_code} ;;
        esac
        exit 9
    """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_backend_without_nvidia_smi_raises_tool_error(tmp_path):
    backend = CudaBackend(DeviceOptions(nvidia_smi=str(tmp_path / "absent" / "nvidia-smi")))
    with pytest.raises(DeviceToolError, match=r"^nvidia-smi --query-gpu could not start: No such file"):
        backend.poll()


def test_backend_discovers_devices_by_index(tmp_path):
    backend = CudaBackend(DeviceOptions(nvidia_smi=fake_smi(tmp_path, MIXED)))
    found = backend.discover()
    assert [d.index for d in found] == [0, 1, 2, 3, 4]
    assert found[3] == Device(3, "Tesla T4", "00000000:5D:00.0")
    assert (backend.kind, backend.visibility_var) == ("cuda", "CUDA_VISIBLE_DEVICES")


def test_backend_polls_health_and_merges_row_remapping(tmp_path):
    smi = fake_smi(tmp_path, MIXED, remap_output="00000000:19:00.0, 0, 1\n00000000:3B:00.0, 0, 0\n")
    statuses = CudaBackend(DeviceOptions(nvidia_smi=smi)).poll()
    assert [(s.device.index, s.health, s.codes) for s in statuses] == [
        (0, Health.ALARM, ("row-remap-failure",)),
        (1, Health.ALARM, ("ecc-uncorrected",)),
        (2, Health.ALARM, ("retired-pages-pending",)),
        (3, Health.OK, ()),
        (4, Health.CRITICAL, ("gpu-lost",)),
    ]


def test_backend_ignores_a_refused_remap_query(tmp_path):
    smi = fake_smi(tmp_path, HEALTHY, remap_output="Field is not a valid field to query.\n", remap_code=2)
    assert CudaBackend(DeviceOptions(nvidia_smi=smi)).poll() == [DeviceReading(device(), Health.OK)]


def test_backend_places_an_unreachable_gpu_by_its_bus_id(tmp_path):
    before = ("0, H100, 00000000:19:00.0, GPU-a, 0, No\n1, H100, 00000000:3B:00.0, GPU-b, 0, No\n"
              "2, H100, 00000000:5D:00.0, GPU-c, 0, No\n")
    # the driver's message spells the domain with 4 digits; GPU 1 is not listed at all
    after = "0, H100, 00000000:19:00.0, GPU-a, 0, No\nUnable to determine the device handle for GPU0000:5D:00.0: Unknown Error\n"
    backend = CudaBackend(DeviceOptions(nvidia_smi=fake_smi(tmp_path, before)))
    backend.poll()
    fake_smi(tmp_path, after, code=15)  # nvidia-smi fails, but still lists the GPUs it reached
    assert [(s.device.index, s.health, s.codes) for s in backend.poll()] == [
        (0, Health.OK, ()), (2, Health.CRITICAL, ("gpu-lost",))]


def test_backend_gives_an_unknown_unreachable_gpu_the_lowest_free_index(tmp_path):
    smi = fake_smi(tmp_path, "Unable to determine the device handle for GPU0000:19:00.0: Unknown Error\n"
                             "1, H100, 00000000:3B:00.0, GPU-b, 0, No\n", code=15)
    statuses = CudaBackend(DeviceOptions(nvidia_smi=smi)).poll()
    assert [(s.device.index, s.device.physical, s.codes) for s in statuses] == [
        (0, "0000:19:00.0", ("gpu-lost",)), (1, "00000000:3B:00.0", ())]


def test_backend_failure_with_nothing_listed_is_a_tool_error(tmp_path):
    smi = fake_smi(tmp_path, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", code=9)
    with pytest.raises(DeviceToolError, match="exited with 9: NVIDIA-SMI has failed"):
        CudaBackend(DeviceOptions(nvidia_smi=smi)).poll()


def test_backend_unreadable_output_is_a_tool_error(tmp_path):
    smi = fake_smi(tmp_path, "No devices were found, or so\n")
    with pytest.raises(DeviceToolError, match="printed something unreadable"):
        CudaBackend(DeviceOptions(nvidia_smi=smi)).poll()


def test_backend_kills_a_hung_nvidia_smi_at_the_timeout(tmp_path):
    smi = fake_smi(tmp_path, HEALTHY, sleep=30)
    backend = CudaBackend(DeviceOptions(nvidia_smi=smi, timeout=0.2))
    with pytest.raises(DeviceToolError, match=r"did not answer within 0.2s"):
        backend.poll()
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _is_child_zombie(int(p))]


def _is_child_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields_ = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields_[0] == "Z" and int(fields_[1]) == os.getpid()
