"""The forward paths: batch layout and micro-batching, packing, the LM-head log-probs, critic and reward readouts."""
