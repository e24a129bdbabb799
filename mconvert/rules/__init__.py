"""How a rule table maps IR tensors to a checkpoint's tensors and back: rules, named transforms, TP/PP/EP layouts."""
