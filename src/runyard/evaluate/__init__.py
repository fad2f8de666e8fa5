"""Held-out evaluation, baselines, samples and the fit-to-ship report."""
