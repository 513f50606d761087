"""Task accuracy: lm-eval tasks scored on the baseline and each artifact, in the engine that serves it.

``quantkit eval ARTIFACT --tasks T1,T2`` (and a recipe's ``evaluation.tasks`` in ``quantkit run``). One job per
module: :mod:`.shipped` (the tasks in ``data/``), :mod:`.resolve` (a task name or YAML checked and built before any
model loads), :mod:`.runner` (one model through lm-eval: its Hugging Face backend on a model quantkit loaded, or
``local-completions`` against the server ``smoke`` starts), :mod:`.baseline` (the baseline's scores cached by model,
task, engine and settings), :mod:`.results` (rows, recovery, gates) and :mod:`.evaluate` (the whole run).
Tested with lm-eval 0.4.13.
"""
