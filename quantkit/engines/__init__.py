"""Engines: what loads an artifact to score it (``eval``) or serve it (``smoke``, ``tune``).

``registry.py`` holds one row per engine; each engine's code is one folder (``transformers/``, ``llamacpp/``,
``vllm/``, ``trtllm/``); beside them, what the engines share: ``logits.py`` (the evaluation protocol's shape),
``serving.py`` and ``client.py`` (a server as a child process, and the HTTP requests to it), ``parallel.py``
(tensor-parallel checks), ``smoke.py`` (``quantkit smoke``) and ``doctor.py`` (``quantkit doctor``).
"""
