"""SGLang: its server (``server.py``), the prompt log-probabilities of the protocol's windows through that server
(``logits.py``), and what SGLang 0.5.17 loads, read from its source (``loads.py``)."""
