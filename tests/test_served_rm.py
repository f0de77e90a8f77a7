"""reward_model_engine=vllm: the reward model on vLLM's pooling runner scores what the trained
stack's forward (forward/readouts.reward_model_scores) scores, read at the same last real token."""
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from config import Config
from forward.batch import pack_batch
from forward.readouts import reward_model_scores
from modeling.loading import load_models
from prompts.sets import PromptSet
from rewards.scoring import Scorer

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo_model"
pytestmark = pytest.mark.slow   # a vLLM engine start


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """The demo model with a random one-label head, and pad = EOS: where Hugging Face's own
    classifier reads the token before the EOS, which a served score must not."""
    from transformers import AutoModelForSequenceClassification
    out = tmp_path_factory.mktemp("rm")
    model = AutoModelForSequenceClassification.from_pretrained(DEMO, num_labels=1)
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.config.pad_token_id = model.config.eos_token_id
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, out)
    return out


def test_served_scores_equal_the_trained_stacks(reward_model_dir):
    cfg = dataclasses.replace(Config(), reward_model_path=str(reward_model_dir), adv_estimator="grpo",
                              use_kl_in_reward=False)
    tokenizer, _, _, _, reward_model = load_models(cfg)
    texts = ["47+38=", "9+9=", "12+300=", "1+1="]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    eos = tokenizer.eos_token_id
    digits = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    responses = [digits("85") + [eos], digits("18") + [eos], digits("3120"), digits("2") + [eos]]   # one cut, no EOS
    batch = pack_batch(ids, responses, tokenizer.pad_token_id)
    with torch.no_grad():
        trained = reward_model_scores(reward_model, batch)                                   # [B]

    served = Scorer(dataclasses.replace(cfg, reward_model_engine="vllm", reward_model_kv_cache_gb=0.1), tokenizer,
                    None)
    served.start(world=1, rank=0)
    try:
        prompts = PromptSet(texts, ids, {})
        scores = served(prompts, responses, batch, micro=2)
        before_last = served(prompts, [r[:-1] for r in responses], pack_batch(ids, [r[:-1] for r in responses],
                                                                              tokenizer.pad_token_id), micro=2)
    finally:
        served.shutdown()
    assert torch.allclose(scores, trained.float(), rtol=1e-5, atol=1e-4), (scores, trained)
    # the score moves by far more than the tolerance when read one token earlier: the equality above
    # holds at the last real token only
    assert (scores - before_last).abs().min() > 1e-2, (scores, before_last)
