"""Megatron-Core integration: the only package of megatron_dualpipe that imports megatron.core.

Import its submodules explicitly (``megatron_dualpipe.megatron.cpu_compat``,
``megatron_dualpipe.megatron.tiny_models``); importing this package alone imports
neither torch nor megatron.
"""
