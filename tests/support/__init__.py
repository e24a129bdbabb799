"""What the tests share, imported by test modules and conftest files (a test module never imports another).

    models.py     every tiny model: FAMILIES (the HF model each family's conversions start from), mtrain's sections
    compare.py    IR tensors and HF files bit for bit, transformers' logits
    cli.py        `mconvert` and `mtrain` in-process, megatron-core's scripts in their environments
    corpus.py     the small corpus mtrain trains on;  training.py  tiny runs and parity with one process
    reference.py  the IR of transformers models by a test-side mapping
    paths.py      the repository, the shared fixtures
"""
