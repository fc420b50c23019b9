"""``ftrun top``: an interactive view of a running job, from any machine that reaches its store.

``source`` reads (and, for the operator's actions, writes) the store; ``panes`` turns what it read into
text, with no terminal in it; ``app`` is the textual application, the only module here that imports textual
(a dependency of ftrun, imported only when a view opens: the launcher starts without it). ``attached`` runs
the same view on the controller's own terminal.
"""
