"""Layer 2: execute lowered schedules with torch (CPU+gloo or CUDA+NCCL)."""
