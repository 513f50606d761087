"""llama.cpp: GGUF files scored through llama-cpp-python (logits.py) and served by llama-server (server.py)."""
