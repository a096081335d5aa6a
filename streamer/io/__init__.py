"""What comes in and goes out: Hugging Face checkpoints, tokenizers, datasets."""
