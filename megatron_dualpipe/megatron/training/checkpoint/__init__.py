"""The trainer's checkpoint room: save and load with dist_checkpointing (:mod:`.save_load`),
what a checkpoint folder holds on disk (:mod:`.files`), reading its pickles without running
code (:mod:`.trust`), one run per save folder (:mod:`.lock`) and the writer processes
(:mod:`.writer_watch`). It imports the config room and the trainer's shared leaves."""
