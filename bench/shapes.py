"""Model shapes the benchmarks build with random weights (Llama 3.x configs), shared by every bench script."""

from __future__ import annotations


def llama3_rope(factor: float) -> dict:
    """Llama 3.x rope scaling: factor 8 for Llama-3.1, 32 for Llama-3.2."""
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False, rope_scaling=llama3_rope(8.0)),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, rope_scaling=llama3_rope(8.0)),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
               rope_scaling=llama3_rope(32.0)),  # Llama-3.2-1B
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
               rope_scaling=llama3_rope(32.0)),  # Llama-3.2-3B
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
               rope_scaling=llama3_rope(8.0)),  # Llama-3.1-8B
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                rope_scaling=llama3_rope(8.0)),  # Llama-3.1-70B
}
