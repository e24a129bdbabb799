"""`python -m mtrain ...` (and `torchrun ... -m mtrain pretrain ...`)."""

from mtrain.cli import main

main(prog_name="mtrain")
