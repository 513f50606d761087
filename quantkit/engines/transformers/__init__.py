"""transformers: the evaluation engine of the baseline and of Hugging Face checkpoints (logits.py), and the dense
copy it scores where it cannot reload a checkpoint itself (dense_copy.py)."""
