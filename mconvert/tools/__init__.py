"""The top floor: `mconvert inspect`, `compare` and `verify`; only verify may import mtrain."""
