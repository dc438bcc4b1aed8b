"""Gradient room: deferred wgrad, TE wgrad, mirror, loss reports; imports model/ compat/."""
