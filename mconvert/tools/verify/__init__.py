"""`mconvert verify A B`: prove numerically that two checkpoints (any formats, layouts, families) are one model.

    run.py        load both, run them stage by stage on the same tokens, compare, judge
    stages.py     one checkpoint through mtrain's model, one layer's weights in memory at a time: the embedding
                  path on every token id ("table" stages), the layers, the logits, the MTP modules
    tensors.py    every tensor compared whole, pair by pair: equal, or equal to its reference rounding in a cast
    reference.py  one side through transformers instead (`--reference transformers`)
    metrics.py    max |logit difference|, mean KL divergence, top-1 agreement; hidden-state distances
    tolerance.py  exact for same dtypes; bounds measured from a cast reference for casts; transformers' slack
    fields.py     which config fields change the outputs
    report.py     text, one summary line, JSON

Importing this package imports torch and mtrain; the command line imports it only when verifying.
"""

from mconvert.tools.verify.run import Report, VerifySettings, verify

__all__ = ["Report", "VerifySettings", "verify"]
