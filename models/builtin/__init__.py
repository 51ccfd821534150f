"""The built-in tiny models, one Hugging Face directory each: `kvforge-tiny` and
`kvforge-tiny-draft`. Trained by `scripts/train_tiny.py`; see docs/models.md."""
