"""Built-in `structured_output` backends, one module per grammar library
(`kvforge[structured]` installs all three); `tracked_grammar` holds what they share."""
