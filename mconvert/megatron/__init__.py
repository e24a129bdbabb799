"""Megatron checkpoints: one module per storage format (torch_format, dist, dcp, legacy) beside the key tables
(core.py, moe.py, mla.py) and the args <-> config mapping (arguments.py)."""
