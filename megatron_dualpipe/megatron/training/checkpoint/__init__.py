"""The trainer's checkpoint room: save and load with dist_checkpointing (:mod:`.save_load`,
reading folders through the adapter's :mod:`...checkpoint`) and the writer processes
(:mod:`.writer_watch`). It imports the config room and the trainer's shared leaves."""
