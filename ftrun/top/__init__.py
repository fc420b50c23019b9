"""``ftrun top``: an interactive view of a running job, from any machine that reaches its store.

``source`` reads (and, for the operator's actions, writes) the store; ``panes`` turns what it read into
text, with no terminal in it; ``app`` is the textual application (textual is an optional extra:
``pip install 'ftrun[top]'``), the only module here that imports it. ``attached`` runs the same view on
the controller's own terminal.
"""
