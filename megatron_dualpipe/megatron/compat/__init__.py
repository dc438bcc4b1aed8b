"""Compatibility room: versions, CPU shims, warnings, Megatron-LM patch; no other room."""
