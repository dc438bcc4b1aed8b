"""Megatron-Core's indexed datasets on disk, for Megatron-LM's loop and ours alike: a
``.bin`` and its ``.idx`` read and checked (:mod:`.indexed_files`), and the datasets a run
names checked against each other before any rank starts (:mod:`.file_checks`). It imports
no other room."""
