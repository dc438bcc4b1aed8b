"""A Megatron checkpoint folder on disk, for the route and the trainer alike: what an
iteration folder holds and whether it loads (:mod:`.files`), its pickles read without
running code (:mod:`.trust`), one run per save folder (:mod:`.lock`). It imports the
adapter's ``compat`` room only."""
