"""Build the judge recipe's tiny judge (configs/demo_judge.yaml): a causal LM that rates an answer.

    python examples/make_demo_judge.py        # from the repository root; a second, no training

Writes examples/demo_judge_model/: a one-layer Qwen2 on the demo's character tokenizer, with a chat
template that passes the user message through, and examples/demo_judge_template.jinja.

The judge reads "47+38=85" (the prompt, then the answer) and writes one character: the answer's
last digit, its score out of 9 (rewards.judge:score_in_range with reward_judge_range 0,9). So it
prefers answers that end in a high digit, a property the demo policy shows now and then (about
one answer in ten ends in 9), and PPO against this judge alone teaches it to end answers high.

The weights are set, not trained, so the verdict is the same function of the text on every CPU:
the layer's output projections are zero, so the last position's hidden state is its token's
embedding, a one-hot; the LM head maps each digit's one-hot to that digit and everything else
(a prompt's "=", an empty answer) to "?", which no parser reads as a number. The margin between
the chosen logit and the rest is about 100, far beyond any float rounding.
"""

from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from make_demo import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_char_tokenizer

EXAMPLES = Path(__file__).resolve().parent
MODEL_DIR = EXAMPLES / "demo_judge_model"
TEMPLATE = EXAMPLES / "demo_judge_template.jinja"
HIDDEN = 128          # >= VOCAB_SIZE: every token gets its own embedding axis
MARGIN = 10.0         # head weight; times sqrt(HIDDEN) after the final RMSNorm = the logit margin
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def verdict_of(char: str) -> str:
    """The judge's one-character verdict on a text whose last character is `char`."""
    return char if char.isdigit() else "?"


def build_judge(tokenizer) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()    # no attention output: the residual stream is the embedding
        layer.mlp.down_proj.weight.zero_()       # no MLP output either
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB_SIZE, HIDDEN))   # token i -> axis i
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(VOCAB_SIZE, HIDDEN)
        vocab = tokenizer.get_vocab()
        for token, i in vocab.items():
            head[vocab[verdict_of(token) if len(token) == 1 else "?"], i] = MARGIN
        model.lm_head.weight.copy_(head)
    return model


def main() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_judge(tokenizer)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                                               do_sample=False)
    model.save_pretrained(MODEL_DIR)
    tokenizer.save_pretrained(MODEL_DIR)
    TEMPLATE.write_text("{{ prompt }}{{ response }}\n")
    print(f"wrote {MODEL_DIR} and {TEMPLATE}")


if __name__ == "__main__":
    main()
