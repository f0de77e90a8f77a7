"""Models: loading (actor, critic, ref, reward model, tokenizer, LoRA), the optimizer, value heads."""
