"""One module per checkpoint format: its rule table and its config mapping, shared by its loader and saver."""
