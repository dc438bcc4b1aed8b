"""Schedule generators: each builds a compute-only :class:`~..ir.Schedule` from legal
parameters. Which parameters are legal, and every other fact about a schedule, is its
:class:`~..registry.ScheduleSpec`; build schedules through :func:`..registry.generate`."""
