"""The detection wing: how the launcher finds out that something on a node is wrong, and how bad it is.

* ``sources.py``: the seam every detector fits (``HealthSource``, its frozen ``HealthEvent``), the node's
  sources polled as one (``NodeHealth``), a slow source polled in a thread of its own (``Background``);
* ``device_tool.py``, ``hang.py``, ``links.py``: the sources, a device tool's readings, the ranks' signs of
  life, and the data link's state from the OS (``hccn_tool`` on Ascend);
* ``table.py`` and ``fault_levels.yaml``: the fault levels and the table that assigns them, a section per
  source that reports codes;
* ``exits.py``, ``oom.py``: why a worker ended, and the OOM killer's evidence;
* ``probe.py``: what ``ftrun probe`` and ``--preflight`` report; ``preflight.py`` and ``pairs.py``: the
  preflight's matmul per device and its bandwidth check between nodes on the data network, and the verdict.

The device tools themselves (discovery, readings, resets) are ``ftrun.devices``, below this wing; what the
agent does about a finding is the agent's.
"""
