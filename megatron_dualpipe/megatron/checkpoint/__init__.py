"""A Megatron checkpoint folder on disk, for ``train``: what an iteration folder holds and
whether it loads (:mod:`.files`), its pickles read without running code (:mod:`.trust`), one
run per save folder (:mod:`.lock`), the checkpoint writer's queue made to die with the rank
(:mod:`.writer_queue`). It imports the adapter's ``compat`` room only."""
