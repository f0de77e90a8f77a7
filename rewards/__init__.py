"""Reward functions for PPO, picked by `reward_fn="module:function"`: each is called as
`fn(prompts, responses) -> list[float]`; a function whose signature has more parameters after those
two (rewards.gsm8k's `ground_truth`) names dataset columns it needs, one value per sample."""
