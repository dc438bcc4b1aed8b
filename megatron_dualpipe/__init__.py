"""megatron-dualpipe: DualPipe and DualPipeV pipeline schedules for Megatron-Core."""

__version__ = "0.1.0"
