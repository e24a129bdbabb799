"""mtrain: the trainer that builds its models from the mconvert IR.

Model code: models/ (architecture, IR names). Parallelism: parallelize.py. Data: data/ (Megatron indexed
datasets, GPT samples, blends). Training: train.py, optim.py, checkpoint.py (DCP). Command line: cli.py.
"""
