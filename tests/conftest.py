"""The repository root on sys.path, so tests import train_ppo, kl, rollout, rewards and examples
however pytest is started."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
