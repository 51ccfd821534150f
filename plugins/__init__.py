"""Built-in implementations of the non-attention kinds, one module per plugin."""
