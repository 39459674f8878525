"""Optimizers over ShardGroups (CPU/GPU fused Adam/AdamW, NVMe sub-group swap), loss scaling,
DeepSpeed's LR schedules."""
