"""A stand-in for the mindspore package, found where PYTHONPATH names this folder: it lets a worker's python
pass ftrun's "can it import mindspore" check, so that the launch contract (the scheduler, the MS_* variables,
the restarts) is tested without the 2.5 GB package. It stands in for nothing else; tests/workers/ms_contract.py
never imports it."""
