"""mtrain's model code: architecture (model.py, moe.py, rope.py) and the IR name table (state_dict_adapter.py)."""
