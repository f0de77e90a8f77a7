"""Issue 39, section 2: every turn's chat template checked, not only at startup.

Three templates written out in tests/data/chat_templates pass a startup probe without a system
message, reasoning or a failed call, yet the trajectory built token by token differs from what they
render: r1_strips_reasoning_every_render (DeepSeek-R1's habit), nudge_after_error (a generation
prompt that no later rendering keeps) and system_into_last_user (Mistral's habit). Each is refused by
the startup probe now, and, where the probe is skipped, by the per-turn check of a real multi-turn
rollout (the hf engine on a tiny Qwen2 that memorised the conversations) at the first turn whose
context differs. Qwen2.5's and Llama 3.1's templates pass rollouts of several rounds with failed calls
and several calls per turn; chat_template_kwargs reaches every rendering.
"""
import pandas as pd
import pytest
import torch
import yaml
from transformers import PreTrainedTokenizerFast

from config import Config, load_config
from errors import UserError
from prompts.sets import load_prompts
from rollout import RolloutOutput, SamplingParams
from rollout.tools import ChatFormat, ToolEnvironment, ToolSet, check_template, run_multiturn
from rollout.tools.rollouts import ToolRollouts
from test_tools import CALC, TEMPLATES, ScriptedEngine, call_text, llama3_style_tokenizer, memorise, qwen_style_tokenizer

THINK = ("What is 6*7?", ["<think>\nUse the tool.\n</think>\n\n" + call_text("calculator", {"expression": "6*7"}),
                          "It is 42."])
# three rounds: two calls (one fails) in the first turn, an empty reasoning block in the second
ROUNDS = ("Compute 6*7 and 1/0, then 2**10.",
          [call_text("calculator", {"expression": "6*7"}) + "\n" + call_text("calculator", {"expression": "1/0"}),
           "<think>\n\n</think>\n\n" + call_text("calculator", {"expression": "2**10"}),
           "42, undefined, 1024."])
SYSTEM = "Be brief."
# what system_into_last_user renders for [system SYSTEM, user "What is 6*7?"]: the prompt this model memorised
SYSTEM_IN_USER = (f"{SYSTEM}\n\nWhat is 6*7?", [call_text("calculator", {"expression": "6*7"}), "It is 42."])


@pytest.fixture(scope="module")
def calc():
    return ToolSet.from_specs([CALC])


def saved(directory, template, make=qwen_style_tokenizer):
    """A tokenizer written to `directory` with `template` and loaded back, as a run loads model_path's:
    its chat template is then directory/chat_template.jinja, the file errors name."""
    tokenizer = make()
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    tokenizer.save_pretrained(directory)
    loaded = PreTrainedTokenizerFast.from_pretrained(directory)
    assert (directory / "chat_template.jinja").is_file() and loaded.name_or_path == str(directory)
    return loaded


# --- the startup probe -----------------------------------------------------------------------------

@pytest.mark.parametrize("template, with_tools, turn, token", [
    # the generated <think> is not in any rendering: the trajectory has '<' where the template has the call
    ("r1_strips_reasoning_every_render.jinja", True, "before assistant turn 2",
     "the trajectory has '<', the template renders '<tool_call>'"),
    ("r1_strips_reasoning_every_render.jinja", False, "before assistant turn 2",
     "the trajectory has '<', the template renders '<tool_call>'"),
    # the nudge after the failed call is gone once assistant turn 2 is rendered
    ("nudge_after_error.jinja", True, "appending assistant turn 2", "'T' becomes '<'"),
    ("nudge_after_error.jinja", False, "appending assistant turn 2", "'T' becomes '<'"),
    # the system prompt leaves the user turn for the system turn: with tools, "You are Qwen" (the default
    # beside the schemas) becomes "You are a careful"; without, the first turn's role user becomes system
    ("system_into_last_user.jinja", True, "appending assistant turn 1", "'Q' becomes 'a'"),
    ("system_into_last_user.jinja", False, "appending assistant turn 1", "'u' becomes 's'"),
])
def test_held_out_templates_are_refused_at_startup(tmp_path, calc, template, with_tools, turn, token):
    tokenizer = saved(tmp_path, template)
    with pytest.raises(UserError) as e:
        check_template(ChatFormat(tokenizer, calc.schemas if with_tools else None))
    message = str(e.value)
    assert message.startswith(f"startup probe: chat template {tmp_path / 'chat_template.jinja'}")
    assert turn in message and token in message and "\n" not in message


@pytest.mark.parametrize("make", [qwen_style_tokenizer, llama3_style_tokenizer])
def test_good_templates_pass_the_probe(make, calc):
    check_template(ChatFormat(make(), calc.schemas))
    check_template(ChatFormat(make()))


# --- the per-turn check on scripted replies (fast) -------------------------------------------------

@pytest.mark.parametrize("make", [qwen_style_tokenizer, llama3_style_tokenizer])
def test_good_templates_pass_three_rounds_with_a_failed_call_and_two_calls_in_a_turn(make, calc):
    """The per-turn check passes: each trajectory is the template's rendering of its conversation."""
    tokenizer = make()
    chat = ChatFormat(tokenizer, calc.schemas)
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ROUNDS[0]}],
               [{"role": "user", "content": THINK[0]}]]
    engine = ScriptedEngine(tokenizer, [ROUNDS[1], THINK[1]])
    engine.rows = [chat.prompt_ids(p) for p in prompts]
    trajectories = run_multiturn(engine, chat, prompts, [ToolEnvironment(calc) for _ in prompts],
                                 SamplingParams(temperature=1.0), 10_000, 4)
    assert [(t.turns, t.tool_calls, t.tool_errors, t.stop_reason) for t in trajectories] == [
        (3, 3, 1, "done"), (2, 1, 0, "done")]
    for t in trajectories:
        full = chat.render(t.messages, add_generation_prompt=False)
        assert t.prompt_ids + t.response_ids == full[:len(t.prompt_ids) + len(t.response_ids)]
    assert "error: calculator: division by zero" in tokenizer.decode(trajectories[0].response_ids)


class FixedTurns:
    """The rollout protocol returning fixed id lists, turn after turn, for one trajectory: ids a model
    may generate that the tokenizer would not produce from their text."""
    name = "fixed"

    def __init__(self, turns):
        self.turns = list(turns)

    def generate(self, prompts, params, share=None):
        ids = self.turns.pop(0)
        return RolloutOutput(responses=[ids], logprobs=[[-0.5] * len(ids)])


def test_generated_ids_that_retokenize_differently_stop_the_run(calc):
    """A call spelled byte by byte ('<', 't', ...) decodes to the text of the <tool_call> token, which the
    template's rendering tokenizes as that one token: the trajectory is not what the model would see at
    inference, so turn 2 is refused naming the first differing token."""
    tokenizer = qwen_style_tokenizer()
    chat = ChatFormat(tokenizer, calc.schemas)
    call = call_text("calculator", {"expression": "6*7"})
    by_byte = tokenizer.convert_tokens_to_ids([_BYTE_LEVEL[b] for b in call.encode()])
    assert tokenizer.decode(by_byte) == call and tokenizer(call, add_special_tokens=False)["input_ids"] != by_byte
    engine = FixedTurns([by_byte + [tokenizer.eos_token_id]])   # turn 2 is never asked for
    prompt = [{"role": "user", "content": "What is 6*7?"}]
    with pytest.raises(UserError) as e:
        run_multiturn(engine, chat, [prompt], [ToolEnvironment(calc)], SamplingParams(temperature=1.0), 10_000, 4)
    message = str(e.value)
    at = len(chat.prompt_ids(prompt))
    assert "before assistant turn 2, the trajectory differs" in message and "\n" not in message
    assert f"at token {at}: the trajectory has '<', the template renders '<tool_call>'" in message


def test_an_id_beyond_the_tokenizer_stops_the_run_naming_it(calc):
    """A model's embedding may have rows past the tokenizer's vocabulary (Qwen2.5's has 151,936 for
    151,665 tokens) and sampling may pick one: it decodes to no text, so the rendering lacks it."""
    tokenizer = qwen_style_tokenizer()
    chat = ChatFormat(tokenizer, calc.schemas)
    spare = len(tokenizer) + 2
    call = tokenizer(call_text("calculator", {"expression": "6*7"}), add_special_tokens=False)["input_ids"]
    engine = FixedTurns([call[:5] + [spare] + call[5:] + [tokenizer.eos_token_id]])
    prompt = [{"role": "user", "content": "What is 6*7?"}]
    with pytest.raises(UserError) as e:
        run_multiturn(engine, chat, [prompt], [ToolEnvironment(calc)], SamplingParams(temperature=1.0), 10_000, 4)
    at = len(chat.prompt_ids(prompt)) + 5
    assert (f"at token {at}: the trajectory has id {spare}, which the tokenizer cannot decode (it has "
            f"{len(tokenizer)} tokens), the template renders {tokenizer.decode(call[5:6])!r}") in str(e.value)


def _byte_level_table() -> list[str]:
    """GPT-2's byte -> printable character table (the ByteLevel vocabulary's spelling of each byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra, table = 0, []
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


# --- the per-turn check in real rollouts (hf engine, memorised tiny Qwen2) ---------------------------

@pytest.fixture(scope="module")
def qwen_model(calc):
    """Memorised under Qwen2.5's template: a reasoning turn, three rounds, and the prompt that
    system_into_last_user makes of a system message."""
    return memorise(qwen_style_tokenizer(), calc, [THINK, ROUNDS, SYSTEM_IN_USER])[1:]


@pytest.fixture(scope="module")
def nudge_model(calc):
    """Memorised under nudge_after_error's own rendering (the nudge in turn 2's context)."""
    return memorise(qwen_style_tokenizer("nudge_after_error.jinja"), calc, [ROUNDS])[1:]


def hf_rollout(model, chat, prompts, tools, **limits):
    from rollout.hf import HFEngine
    engine = HFEngine(model, chat.tokenizer.eos_token_id, chat.tokenizer.pad_token_id)
    torch.manual_seed(0)
    return run_multiturn(engine, chat, prompts, [ToolEnvironment(tools) for _ in prompts],
                         SamplingParams(temperature=0.1), **{"max_response_length": 1000, "max_turns": 4, **limits})


@pytest.mark.slow
def test_qwen_template_passes_a_real_multi_round_rollout(tmp_path, qwen_model, calc):
    model, rows = qwen_model
    chat = ChatFormat(saved(tmp_path, "qwen2_5.jinja"), calc.schemas)
    prompts = [[{"role": "user", "content": q}] for q, _ in (THINK, ROUNDS, SYSTEM_IN_USER)]
    trajectories = hf_rollout(model, chat, prompts, calc)
    for t, (_, ids, _) in zip(trajectories, rows):
        assert t.prompt_ids + t.response_ids == ids and t.stop_reason == "done"
    assert [(t.turns, t.tool_calls, t.tool_errors) for t in trajectories] == [(2, 1, 0), (3, 3, 1), (2, 1, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("template, messages, turn, token", [
    ("r1_strips_reasoning_every_render.jinja", [{"role": "user", "content": THINK[0]}],
     "before assistant turn 2", "the trajectory has '<', the template renders '<tool_call>'"),
    # the prompt put the system message in the user turn; from turn 2 on it is in the system turn
    ("system_into_last_user.jinja", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 6*7?"}],
     "before assistant turn 2", "the trajectory has 'Y', the template renders 'B'"),
    # turn 2 was generated after the nudge; rendering turn 2 leaves the nudge out
    ("nudge_after_error.jinja", [{"role": "user", "content": ROUNDS[0]}],
     "before assistant turn 3", "the trajectory has 'T', the template renders '<'"),
])
def test_held_out_templates_stop_a_real_rollout_at_the_first_differing_turn(tmp_path, qwen_model, nudge_model, calc,
                                                                          template, messages, turn, token):
    """As if the startup probe had missed them: the run stops with one line naming the template file,
    the turn and the token, before a turn is generated from a context the template would not render."""
    model, _ = nudge_model if template.startswith("nudge") else qwen_model
    chat = ChatFormat(saved(tmp_path, template), calc.schemas)
    with pytest.raises(UserError) as e:
        hf_rollout(model, chat, [messages], calc)
    message = str(e.value)
    assert message.startswith(f"chat template {tmp_path / 'chat_template.jinja'}: {turn}, the trajectory differs")
    assert token in message and "\n" not in message


# --- chat_template_kwargs ---------------------------------------------------------------------------

def test_chat_template_kwargs_from_the_command_line_and_yaml(tmp_path):
    assert Config().chat_template_kwargs == {}
    assert load_config(['--chat_template_kwargs={"enable_thinking": false}']).chat_template_kwargs == {
        "enable_thinking": False}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"chat_template_kwargs": {"enable_thinking": False, "effort": "low"}}))
    assert load_config(["--config", str(path)]).chat_template_kwargs == {"enable_thinking": False, "effort": "low"}
    for bad, words in (("[1, 2]", "a mapping with string keys"), ("{enable_thinking: false}", "JSON on the command line"),
                       ('{"1": 2, "x": {"y": 1}}', None)):
        if words is None:   # nested values are the template's business
            assert load_config([f"--chat_template_kwargs={bad}"]).chat_template_kwargs == {"1": 2, "x": {"y": 1}}
            continue
        with pytest.raises(UserError) as e:
            load_config([f"--chat_template_kwargs={bad}"])
        assert "chat_template_kwargs" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)
    path.write_text("chat_template_kwargs: {1: true}\n")
    with pytest.raises(UserError, match="string keys"):
        load_config(["--config", str(path)])


def test_chat_template_kwargs_reach_the_prompts_and_every_tool_turn(tmp_path, calc):
    """thinking_switch.jinja writes a /no_think system turn with enable_thinking=false: it is in the
    prompts loaded from data, in the tool rollouts' prompt ids (which pass the probe with it), and in
    the rendering the per-turn check compares a real trajectory to."""
    (tmp_path / "tok").mkdir()
    tokenizer = saved(tmp_path / "tok", "thinking_switch.jinja")
    kwargs = {"enable_thinking": False}
    data = tmp_path / "prompts.jsonl"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "What is 6*7?"}]]}).to_json(data, orient="records", lines=True)
    switched = load_prompts(str(data), "prompt", tokenizer, 1024, "error", template_kwargs=kwargs)
    plain = load_prompts(str(data), "prompt", tokenizer, 1024, "error")
    assert switched.texts[0].startswith("<|im_start|>system\n/no_think<|im_end|>\n")
    assert switched.ids[0][len(switched.ids[0]) - len(plain.ids[0]):] == plain.ids[0] and "/no_think" not in plain.texts[0]

    tools = ToolRollouts(Config(tools=CALC, chat_template_kwargs=kwargs), tokenizer)   # runs the startup probe
    messages = [{"role": "user", "content": "What is 6*7?"}]
    assert tokenizer.decode(tools.chat.prompt_ids(messages)).startswith("<|im_start|>system\n/no_think<|im_end|>")
    assert "/no_think" not in tokenizer.decode(ToolRollouts(Config(tools=CALC), tokenizer).chat.prompt_ids(messages))
    engine = ScriptedEngine(tokenizer, [THINK[1]])
    engine.rows = [tools.chat.prompt_ids(messages)]
    [t] = run_multiturn(engine, tools.chat, [messages], [ToolEnvironment(calc)], SamplingParams(temperature=1.0),
                        10_000, 4)
    assert (t.turns, t.tool_calls, t.stop_reason) == (2, 1, "done")
    assert tokenizer.decode(t.prompt_ids + t.response_ids).startswith("<|im_start|>system\n/no_think<|im_end|>")
    # a trajectory rendered with the switch is not the rendering without it: the check compares like with like
    unswitched = ChatFormat(tokenizer, calc.schemas)
    with pytest.raises(UserError, match="before assistant turn 2"):
        unswitched.observation_ids(t.messages[:2], ["42"], t.prompt_ids + t.response_ids[:t.mask.index(0)], 2)
