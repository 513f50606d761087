"""Engines: load an artifact and give next-token log-probabilities for token windows (see :mod:`.base`)."""
