"""What a fault means, as data: fault levels, the table that maps codes and messages to them
(``fault_levels.yaml``, extensible per site), escalation of repeat offenders, and the
classification of a worker that ended (``ftrun.faults.process``).
"""
