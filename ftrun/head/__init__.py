"""The head node's wing: where a job runs (hostfiles and ``--include``/``--exclude`` in ``hosts.py``, a
Slurm allocation in ``slurm.py``) and SSH mode, one command on a head node that starts an agent per host
(the ssh sessions in ``sessions.py``; the head under the c10d store in ``c10d.py``, under etcd in
``etcd.py``; on each host under etcd, the session's keeper in ``session_keeper.py``)."""
