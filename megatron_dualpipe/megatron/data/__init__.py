"""Megatron-Core's indexed datasets on disk, for Megatron-LM's loop and ours alike: a
``.bin`` and its ``.idx`` read and checked (:mod:`.indexed_files`), the datasets a run names
checked against each other before any rank starts (:mod:`.file_checks`), and the commands
that make them: ``preprocess`` (:mod:`.preprocess`) and ``make-tokenizer``
(:mod:`.make_tokenizer`), over a Hugging Face tokenizer directory (:mod:`.hf_tokenizer`). It
imports no other room."""
