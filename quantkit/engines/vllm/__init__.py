"""vLLM: prompt log-probabilities in a worker of vLLM's own Python (logits.py, _logits_worker.py), its server
(server.py), the kernels it can run per scheme (kernels.py), measuring them (kernel_sweep.py, _speed_worker.py) and
``quantkit tune`` (tune.py)."""
