"""ftrun's integrations of frameworks' own training loops, one module per framework, and what they share.

Each drives the job's step protocol (``ElasticJob.start_steps``, ``begin_step``, ``end_step``) from the
framework's own hooks, and holds nothing of the repair itself: ``hf.py`` (the Hugging Face ``Trainer``),
``lightning.py`` (PyTorch Lightning's ``Trainer``), ``shared.py`` (the job joined at import, the RNG states,
wrapping one instance's method). A new framework is one module here and one test worker; docs/integrations.md
has the checklist, and tests/unit/test_integrations.py holds it. Scripts import the first two by their short
names, ``ftrun.elastic.hf`` and ``ftrun.elastic.lightning``, the very same modules.
"""
