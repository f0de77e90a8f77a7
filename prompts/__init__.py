"""Prompt and SFT sets (read, rendered, tokenized) and the streams that order them."""
