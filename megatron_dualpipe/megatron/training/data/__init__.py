"""The trainer's data room: the samples each micro-batch reads (:mod:`.samples`), Megatron-Core's
datasets and indexed files, tokenizers, and the ``preprocess`` and ``make-tokenizer``
commands. It imports the config room and the trainer's shared leaves (errors, writable)."""
