"""Regenerate the tool demo's assets: data, tokenizer and a warm-started tiny model that can call the
calculator (issue 22, "a recipe that learns, on a CPU").

    python examples/make_demo_tools.py   # from the repository root; about 5 minutes on 2 shared CPU cores

Writes, deterministically (fixed seeds, no network):
    examples/data/tools_train.parquet, examples/data/tools_val.parquet   prompts like "347*29=" (+ answers)
    examples/demo_tools_model/        tiny Qwen2 + a character tokenizer with Qwen2.5's chat template

`python train_ppo.py --config configs/demo_tools.yaml` runs PPO from it with the built-in calculator
(`rollout.tools.builtin:calculator`) and rewards.arithmetic:final_answer_score (1 when the last number of
the final assistant turn is the product).

The task: 3-digit x 2-digit products (4 or 5 digits). A model this small cannot multiply, but it can
copy: write `<tool_call>{... "expression": "347*29"}</tool_call>`, read `10063` in the tool response and
answer "The answer is 10063.". The warm start is a supervised run on traces of both kinds, 30% that call
the calculator and use its result and 70% that answer directly with the true product. It learns both
formats and learns to copy, and it learns to call the tool with probability about 0.3 whatever the
prompt: so greedy decoding (validation) answers directly and is almost always wrong, sampling at T=1
calls the tool about a third of the time and is then right. PPO has to learn that calling pays.

The tokenizer is one token per character (printable ASCII and newline) plus whole-string tokens for
the chat template's fixed text: ChatML's markers and roles, the tool tags, the call's JSON around the
expression, and the whole system message with the calculator's schema (one token instead of about
820 characters: a real BPE tokenizer would take ~250, and the demo must be cheap on 2 cores). The
template is Qwen2.5's (tests/data/chat_templates/qwen2_5.jinja), which passes the trainer's
prefix check; the EOS is its end-of-turn token <|im_end|>, the pad token <|endoftext|>.
"""

import json
import random
import shutil
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast

EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent
sys.path.insert(0, str(ROOT))
from examples.make_demo import build_tiny_qwen2  # noqa: E402
from rewards.arithmetic import final_answer_score  # noqa: E402
from rollout import SamplingParams  # noqa: E402
from rollout.hf import HFEngine  # noqa: E402
from rollout.tools import ChatFormat, ToolEnvironment, ToolSet, calculator, check_template, run_multiturn  # noqa: E402

DATA_DIR = EXAMPLES / "data"
MODEL_DIR = EXAMPLES / "demo_tools_model"
TEMPLATE = ROOT / "tests" / "data" / "chat_templates" / "qwen2_5.jinja"
CALC = "rollout.tools.builtin:calculator"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 0..2: pad, turn start, EOS
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]                   # ids 3..98
CALL_OPEN = '{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}'
PHRASES = ["user", "assistant", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
           CALL_OPEN, CALL_CLOSE]                                   # ids 100.., after the system message (99)
VOCAB_SIZE = 112                                                    # embedding rows while warm-starting

SEED = 0
N_VAL = 200        # validation prompts, disjoint from everything trained on
N_DEV = 200        # held out too: decides when the warm start stops
N_TRAIN = 4000     # PPO prompts; the warm start's traces use the first N_SFT of them
N_SFT = 2000
TOOL_FRACTION = 0.3   # traces that call the calculator; the rest answer directly
SFT_LR = 2e-3
SFT_BATCH = 64
SFT_EVAL_EVERY = 100
SFT_MAX_STEPS = 3000
TARGET_COPY_ACC = 0.7   # stop when trajectories that call the tool are right this often (dev, T=1); PPO sharpens it
MAX_RESPONSE = 64       # the trajectory budget the config uses (model and tool tokens)
MAX_TURNS = 3


# ----------------------------------------------------------------------------------------------
# Tokenizer


def system_message() -> str:
    """The system message the template writes for the calculator, between <|im_start|> and <|im_end|>."""
    probe = build_tokenizer(with_system=False)
    text = probe.apply_chat_template([{"role": "user", "content": "x"}], tools=ToolSet.from_specs([CALC]).schemas,
                                     tokenize=False)
    start, end = "<|im_start|>", "<|im_end|>"
    assert text.startswith(start + "system\n"), text[:40]
    return text[len(start):text.index(end)]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tokenizer(with_system: bool = True) -> PreTrainedTokenizerFast:
    # Byte-level BPE without merges: one token per character, written in the byte-level alphabet
    # (" " is "Ġ", "\n" is "Ċ") because AutoTokenizer loads a qwen2 model's tokenizer as Qwen2Tokenizer,
    # which puts its own byte-level pre-tokenizer and decoder in place (a plain character vocabulary
    # then loses every space and newline).
    byte_char = pre_tokenizers.ByteLevel.alphabet()
    assert len(byte_char) == 256
    to_byte_level = {chr(b): c for b, c in zip(range(256), _bytes_to_unicode())}
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[to_byte_level[ch]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = TEMPLATE.read_text()
    if with_system:
        # Added (not special) tokens are decoded back into the text and matched leftmost-longest, so
        # the system message wins over the tags inside it, and "user" in a prompt would be one token.
        tokenizer.add_tokens([system_message()] + PHRASES)
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Data and traces


def make_splits(seed: int = SEED) -> tuple[list[tuple[int, int]], ...]:
    """Disjoint (a, b) pairs, a of 3 digits and b of 2, for val, dev and train."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], N_VAL + N_DEV + N_TRAIN)
    return pairs[:N_VAL], pairs[N_VAL:N_VAL + N_DEV], pairs[N_VAL + N_DEV:]


def to_frame(pairs) -> pd.DataFrame:
    return pd.DataFrame({"prompt": [f"{a}*{b}=" for a, b in pairs], "answer": [str(a * b) for a, b in pairs]})


def call_text(expression: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}\n</tool_call>"


def answer_text(answer: str) -> str:
    return f"The answer is {answer}."


def trace(chat: ChatFormat, prompt: str, use_tool: bool) -> tuple[list[int], list[int]]:
    """One conversation as ids, with labels on the assistant's tokens (each turn's EOS included) and
    -100 on the prompt and the tool response: built from the same pieces the rollout appends."""
    tok, eos = chat.tokenizer, chat.tokenizer.eos_token_id
    messages = [{"role": "user", "content": prompt}]
    ids = chat.prompt_ids(messages)
    labels = [-100] * len(ids)
    turns = [call_text(prompt.rstrip("="))] if use_tool else []
    for turn in turns:
        turn_ids = tok(turn, add_special_tokens=False)["input_ids"] + [eos]
        ids, labels = ids + turn_ids, labels + turn_ids
        messages.append({"role": "assistant", "content": turn})
        observation = chat.observation_ids(messages, [calculator(prompt.rstrip("="))])
        messages.append({"role": "tool", "content": calculator(prompt.rstrip("="))})
        ids, labels = ids + observation, labels + [-100] * len(observation)
    final = tok(answer_text(calculator(prompt.rstrip("="))), add_special_tokens=False)["input_ids"] + [eos]
    return ids + final, labels + final


def sft_tensors(chat: ChatFormat, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(SEED + 1)
    rows = [trace(chat, p, rng.random() < TOOL_FRACTION) for p in prompts]
    width = max(len(ids) for ids, _ in rows)
    pad = chat.tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])        # [N, T]
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])         # [N, T]
    return input_ids, labels


# ----------------------------------------------------------------------------------------------
# Evaluation: the trainer's own multi-turn loop, engine and reward


@torch.no_grad()
def evaluate(model, chat: ChatFormat, frame: pd.DataFrame, temperature: float, seed: int = SEED) -> dict:
    """Accuracy, tool calls per sample, and accuracy of the trajectories that called the tool."""
    model.eval()
    torch.manual_seed(seed)
    messages = [[{"role": "user", "content": p}] for p in frame["prompt"]]
    toolset = ToolSet.from_specs([CALC])
    engine = HFEngine(model, chat.tokenizer.eos_token_id, chat.tokenizer.pad_token_id)
    trajectories = run_multiturn(engine, chat, messages, [ToolEnvironment(toolset) for _ in messages],
                                 SamplingParams(temperature=temperature, max_tokens=MAX_RESPONSE),
                                 MAX_RESPONSE, MAX_TURNS)
    scores = final_answer_score(list(frame["prompt"]), [""] * len(frame), [t.messages for t in trajectories])
    called = [s for s, t in zip(scores, trajectories) if t.tool_calls]
    model.train()
    return {"accuracy": sum(scores) / len(scores), "calls": sum(t.tool_calls for t in trajectories) / len(scores),
            "accuracy_when_called": sum(called) / len(called) if called else 0.0}


def warm_start(model, chat: ChatFormat, train: pd.DataFrame, dev: pd.DataFrame) -> int:
    """Supervised run on the traces until the trajectories that call the tool (sampled at T=1 on dev)
    are right TARGET_COPY_ACC of the time; returns the optimizer steps taken."""
    input_ids, labels = sft_tensors(chat, list(train["prompt"][:N_SFT]))   # [N, T], [N, T]
    attention = (input_ids != chat.tokenizer.pad_token_id).long()          # right padding
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    order = torch.Generator().manual_seed(SEED)
    model.train()
    step = 0
    while step < SFT_MAX_STEPS:
        perm = torch.randperm(len(input_ids), generator=order)
        for start in range(0, len(perm) - SFT_BATCH + 1, SFT_BATCH):
            idx = perm[start:start + SFT_BATCH]
            loss = model(input_ids=input_ids[idx], attention_mask=attention[idx], labels=labels[idx]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % SFT_EVAL_EVERY == 0:
                m = evaluate(model, chat, dev, temperature=1.0)
                print(f"  sft step {step:4d}  loss {loss.item():.3f}  dev sampled acc {m['accuracy']:.3f}  "
                      f"calls/sample {m['calls']:.2f}  acc when called {m['accuracy_when_called']:.3f}", flush=True)
                if m["accuracy_when_called"] >= TARGET_COPY_ACC:
                    return step
    raise RuntimeError(f"warm start missed copy accuracy {TARGET_COPY_ACC} in {SFT_MAX_STEPS} steps")


def main() -> None:
    t0 = time.time()
    torch.set_num_threads(2)
    val_pairs, dev_pairs, train_pairs = make_splits()
    val, dev, train = to_frame(val_pairs), to_frame(dev_pairs), to_frame(train_pairs)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    train.to_parquet(DATA_DIR / "tools_train.parquet", index=False)
    val.to_parquet(DATA_DIR / "tools_val.parquet", index=False)
    print(f"data: {len(train)} train, {len(val)} val prompts -> {DATA_DIR}")

    tokenizer = build_tokenizer()
    chat = ChatFormat(tokenizer, ToolSet.from_specs([CALC]).schemas)
    check_template(chat)   # the trainer's startup check
    assert len(tokenizer) <= VOCAB_SIZE, len(tokenizer)
    model = build_tiny_qwen2(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                             max_position_embeddings=128)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = None
    model.config.eos_token_id = tokenizer.eos_token_id
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2, {n_params:,} parameters; warm start on {N_SFT} traces "
          f"({TOOL_FRACTION:.0%} call the calculator) ...")
    steps = warm_start(model, chat, train, dev)
    greedy = evaluate(model, chat, val, temperature=0.0)
    sampled = evaluate(model, chat, val, temperature=1.0)
    print(f"after {steps} sft steps, val greedy: accuracy {greedy['accuracy']:.3f}, calls/sample "
          f"{greedy['calls']:.2f}; sampled at T=1: accuracy {sampled['accuracy']:.3f}, calls/sample "
          f"{sampled['calls']:.2f}, accuracy when called {sampled['accuracy_when_called']:.3f}")

    # the spare rows go before saving: an id past the tokenizer decodes to no text, so a trajectory that
    # sampled one is not what the chat template renders, and the trainer's per-turn check stops the run
    model.resize_token_embeddings(len(tokenizer))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    model.save_pretrained(MODEL_DIR)
    tokenizer.save_pretrained(MODEL_DIR)
    size = sum(f.stat().st_size for f in MODEL_DIR.iterdir())
    print(f"model + tokenizer: {size / 1e6:.2f} MB -> {MODEL_DIR}")
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
