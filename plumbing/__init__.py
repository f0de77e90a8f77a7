"""Run plumbing, one module per concern, called from train_ppo.py in one line with plain values."""
