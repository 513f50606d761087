"""TensorRT-LLM: its server, trtllm-serve, for engine folders and ModelOpt checkpoints (server.py)."""
