"""mtrain: the trainer that builds its models from the mconvert IR (work in progress)."""
