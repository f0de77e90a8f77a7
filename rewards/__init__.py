"""Reward functions for PPO: each is `compute_score(prompts, responses) -> list[float]`, picked by `reward_fn="module:function"`."""
