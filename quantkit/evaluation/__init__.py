"""Verification: the evaluation protocol, perplexity/KLD/top-1 metrics, gates and reports."""
