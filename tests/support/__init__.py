"""What the tests share, imported by test modules and conftest files (a test module never imports another).

    models.py     every tiny model: FAMILIES (the HF model each family's conversions start from), mtrain's sections
    layouts.py    LAYOUTS: the Megatron layouts the conversion tests write, under one naming scheme; FORMATS
    compare.py    IR tensors and HF files bit for bit, transformers' logits
    cli.py        `mconvert` and `mtrain` in-process, megatron-core's scripts in their environments
    corpus.py     the small corpus mtrain trains on;  training.py  tiny runs and parity with one process
    reference.py  the IR of transformers models by a test-side mapping
    paths.py      the repository, the shared fixtures, the scripts run in subprocesses (scripts/, megatron_lm/)
    refusals.py   what every refusal of a hostile input must be (tests/adversarial)
    launch.py     mtrain scenarios under torchrun (scripts/dist_driver.py); gloo_threads.py, what they leave
"""
